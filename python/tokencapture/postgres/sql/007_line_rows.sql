-- tokencapture schema version 7: freezes and reads return a rollout's lines as rows.
--
-- Measured on a 24-call, 2.5 MB agentic rollout (W2's shape): schema 5's log as one bytea
-- value (or one array of lines) took ~10 ms to reach the client, which assembles one 2.5 MB
-- protocol message, where the same lines as 24 rows took ~2-3 ms; the server's aggregation
-- itself cost ~1.5 ms. The first row carries the freeze's outcome and no line; every later
-- row one line (without its newline) and its payload digest, in commit order. The client
-- joins the lines into the log buffer the native decoder takes.

CREATE FUNCTION tokencapture.freeze_lines(p_rollout text, p_snapshot_id text)
RETURNS TABLE (
    status smallint, incomplete boolean, snapshot_id text, version bigint,
    line bytea, digest text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r tokencapture.rollouts;
BEGIN
    r := tokencapture.lock_rollout(p_rollout);
    IF r.retired THEN
        status := 4;
        RETURN NEXT;
        RETURN;
    END IF;
    IF NOT r.frozen THEN
        UPDATE tokencapture.rollouts
            SET frozen = true, snapshot_id = p_snapshot_id, version = rollouts.version + 1
            WHERE rollout_id = p_rollout
            RETURNING * INTO r;
    END IF;
    status := 0;
    incomplete := r.incomplete OR tokencapture.has_dangling_intent(p_rollout);
    snapshot_id := r.snapshot_id;
    version := r.version;
    RETURN NEXT;
    RETURN QUERY
        SELECT NULL::smallint, NULL::boolean, NULL::text, NULL::bigint, e.line, e.digest
        FROM tokencapture.entries e WHERE e.rollout_id = p_rollout ORDER BY e.seq;
END
$$;

CREATE FUNCTION tokencapture.read_lines(p_rollout text, OUT line bytea, OUT digest text)
RETURNS SETOF record
LANGUAGE sql STABLE AS $$
    SELECT e.line, e.digest FROM tokencapture.entries e
    WHERE e.rollout_id = p_rollout ORDER BY e.seq
$$;
