-- tokencapture schema version 5: freezes and reads return the rollout's log as one value.
--
-- The lines come back as the file store's log bytes (each line plus its newline, in commit
-- order) in one bytea instead of an array of lines: less work for the server and one buffer
-- for the client, which hands it to the same native decoder the file store uses.

CREATE FUNCTION tokencapture.freeze_log(
    p_rollout text, p_snapshot_id text,
    OUT status smallint, OUT incomplete boolean, OUT snapshot_id text, OUT version bigint,
    OUT log bytea, OUT digests text[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r tokencapture.rollouts;
BEGIN
    r := tokencapture.lock_rollout(p_rollout);
    IF r.retired THEN
        status := 4;
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
    SELECT coalesce(string_agg(e.line || '\x0a'::bytea, ''::bytea ORDER BY e.seq), ''::bytea),
           coalesce(array_agg(e.digest ORDER BY e.seq), '{}')
        INTO log, digests
        FROM tokencapture.entries e WHERE e.rollout_id = p_rollout;
END
$$;

CREATE FUNCTION tokencapture.read_log(p_rollout text, OUT log bytea, OUT digests text[])
LANGUAGE sql STABLE AS $$
    SELECT coalesce(string_agg(e.line || '\x0a'::bytea, ''::bytea ORDER BY e.seq), ''::bytea),
           coalesce(array_agg(e.digest ORDER BY e.seq), '{}')
    FROM tokencapture.entries e WHERE e.rollout_id = p_rollout
$$;
