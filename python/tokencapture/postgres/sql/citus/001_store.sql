-- Citus bodies for schema version 1 (applied on a Citus deployment right after 001_store.sql;
-- see tokencapture/postgres/_citus.py). Same results as the plain bodies; what differs:
-- * Citus cannot plan a SQL-language function with parameters that reads a distributed table
--   ("parameterized queries for SQL functions"): these read the same rows from PL/pgSQL.
-- * FOR UPDATE on a distributed table needs equality on the distribution column: a batch
--   locks its rollouts one at a time, in rollout id order (so concurrent batches never
--   deadlock), and every statement names one rollout (one shard, routed to its worker).

CREATE OR REPLACE FUNCTION tokencapture.has_dangling_intent(p_rollout text)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (
        SELECT 1 FROM tokencapture.intents i
        WHERE i.rollout_id = p_rollout
          AND NOT EXISTS (
              SELECT 1 FROM tokencapture.entries e
              WHERE e.rollout_id = p_rollout AND e.model_call_id = i.model_call_id));
END
$$;

CREATE OR REPLACE FUNCTION tokencapture.read_lines(
    p_rollout text, OUT line bytea, OUT digest text)
RETURNS SETOF record
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY SELECT e.line, e.digest FROM tokencapture.entries e
        WHERE e.rollout_id = p_rollout ORDER BY e.seq;
END
$$;

CREATE OR REPLACE FUNCTION tokencapture.is_incomplete(p_rollout text)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    flag boolean;
BEGIN
    SELECT r.incomplete INTO flag FROM tokencapture.rollouts r WHERE r.rollout_id = p_rollout;
    RETURN coalesce(flag, false);
END
$$;

CREATE OR REPLACE FUNCTION tokencapture.lock_batch(p_rollouts text[])
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    id text;
BEGIN
    FOR id IN SELECT DISTINCT u FROM unnest(p_rollouts) AS u ORDER BY u LOOP
        PERFORM tokencapture.lock_rollout(id);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION tokencapture.retire(
    p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
BEGIN
    removed := '{}';
    absent := '{}';
    PERFORM tokencapture.lock_batch(p_rollouts);
    FOREACH id IN ARRAY p_rollouts LOOP
        UPDATE tokencapture.rollouts SET retired = true, retired_at = now()
            WHERE rollout_id = id AND NOT retired;
        IF tokencapture.remove_records(id) THEN
            removed := removed || id;
        ELSE
            absent := absent || id;
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION tokencapture.delete(
    p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
    had boolean;
BEGIN
    removed := '{}';
    absent := '{}';
    FOR id IN SELECT DISTINCT u FROM unnest(p_rollouts) AS u ORDER BY u LOOP
        PERFORM 1 FROM tokencapture.rollouts WHERE rollout_id = id FOR UPDATE;
    END LOOP;
    FOREACH id IN ARRAY p_rollouts LOOP
        had := tokencapture.remove_records(id);
        DELETE FROM tokencapture.rollouts WHERE rollout_id = id;
        IF had OR FOUND THEN
            removed := removed || id;
        ELSE
            absent := absent || id;
        END IF;
    END LOOP;
END
$$;
