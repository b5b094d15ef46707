-- Citus body for schema version 5 (applied on a Citus deployment right after 005_staging.sql,
-- before the tables are distributed; see tokencapture/postgres/_citus.py). Every unique index
-- of a distributed table must hold its distribution column, so a staged call's key is unique
-- per rollout here: two rollouts whose ids split one key differently ('a' + 'b/c', 'a/b' +
-- 'c') can both stage it on Citus (docs/citus.md). The functions are the same bodies.

ALTER TABLE tokencapture.staged_calls DROP CONSTRAINT staged_calls_pkey;
ALTER TABLE tokencapture.staged_calls ADD PRIMARY KEY (staging_key, rollout_id);
