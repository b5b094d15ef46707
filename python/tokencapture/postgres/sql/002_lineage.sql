-- tokencapture schema version 2: what a lineage resolver reads.
--
-- A resolver keeps, per rollout, the incarnation it indexed and the last `seq` it read, and
-- fetches only the lines committed past it (one call per resolve; nothing when nothing is new).
-- `seq` is assigned under the rollout row's lock, so commit order is `seq` order and a cursor
-- never skips a line committed later. A different incarnation (the rollout was deleted and its
-- id reused) or a fence means the resolver starts over.

CREATE FUNCTION tokencapture.lineage_tail(
    p_rollout text, p_incarnation bigint, p_after bigint,
    OUT incarnation bigint, OUT retired boolean, OUT last_seq bigint, OUT lines bytea[])
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    r tokencapture.rollouts;
    after bigint := p_after;
BEGIN
    SELECT * INTO r FROM tokencapture.rollouts WHERE rollout_id = p_rollout;
    IF NOT FOUND THEN
        RETURN;  -- every column NULL: no such rollout
    END IF;
    incarnation := r.incarnation;
    retired := r.retired;
    IF r.incarnation IS DISTINCT FROM p_incarnation THEN
        after := 0;
    END IF;
    SELECT coalesce(array_agg(e.line ORDER BY e.seq), '{}'), coalesce(max(e.seq), after)
        INTO lines, last_seq
        FROM tokencapture.entries e WHERE e.rollout_id = p_rollout AND e.seq > after;
END
$$;
