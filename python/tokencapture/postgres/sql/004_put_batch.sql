-- tokencapture schema version 4: puts that arrive together share one call and one commit.
--
-- The client gathers the puts that are waiting for a connection (at most a few dozen) into
-- one call: one round trip, one WAL flush and one function call for all of them, which is
-- most of the cost of a put. Each put keeps its own outcome (a status per put, as
-- tokencapture.put returns); nothing is acknowledged before the shared commit is flushed.
-- Rollout rows are locked in rollout id order, so concurrent batches never deadlock; puts of
-- one rollout keep their order within the batch.

CREATE FUNCTION tokencapture.put_batch(
    p_rollouts text[], p_calls bytea[], p_digests text[], p_lines bytea[])
RETURNS smallint[]
LANGUAGE plpgsql AS $$
DECLARE
    statuses smallint[] := array_fill(0::smallint, ARRAY[cardinality(p_rollouts)]);
    i integer;
BEGIN
    FOR i IN
        SELECT n FROM unnest(p_rollouts) WITH ORDINALITY AS t(id, n) ORDER BY id, n
    LOOP
        statuses[i] := tokencapture.put(p_rollouts[i], p_calls[i], p_digests[i], p_lines[i]);
    END LOOP;
    RETURN statuses;
END
$$;
