-- Schema version 6: a staging batch stores a rollout's keys in key order.
--
-- Version 5's stage_batch took the rollouts in id order but each rollout's stages in the
-- order they were queued. A rollout's fence row is only KEY SHARE locked by a stage, so two
-- batches holding the same keys of one rollout in opposite orders (a worker's retry racing the
-- original) could each insert a key the other then waits for: a deadlock, which PostgreSQL
-- breaks after deadlock_timeout (a second by default) by aborting one batch, which the client
-- then retries. Taking the stages in (rollout id, key) order, one total order for every batch,
-- leaves no such cycle. (Rollout ids keep the database's collation: the order in which
-- retire_staging and delete_staging lock them.) Within one key the queued order stands (the first of two different
-- contents is stored, the second is a conflict), as before.
CREATE OR REPLACE FUNCTION tokencapture.stage_batch(
    p_rollouts text[], p_keys text[], p_digests text[], p_rows bytea[], p_attachments bytea[])
RETURNS smallint[]
LANGUAGE plpgsql AS $$
DECLARE
    statuses smallint[] := array_fill(0::smallint, ARRAY[cardinality(p_rollouts)]);
    i integer;
BEGIN
    FOR i IN
        SELECT n FROM unnest(p_rollouts, p_keys) WITH ORDINALITY AS t(id, k, n)
            ORDER BY id, k COLLATE "C", n
    LOOP
        statuses[i] := tokencapture.stage_call(
            p_rollouts[i], p_keys[i], p_digests[i], p_rows[i], p_attachments[i]);
    END LOOP;
    RETURN statuses;
END
$$;
