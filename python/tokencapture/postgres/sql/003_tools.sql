-- tokencapture schema version 3: what the operator tools need (`tokencapture copy`, `sweep`).
--
-- `retired_at` is when the fence was set (a sweep deletes fences older than a duration); the
-- export and import functions move one rollout whole, byte for byte, with its version,
-- snapshot id, flags, intents and incomplete marks.

ALTER TABLE tokencapture.rollouts ADD COLUMN retired_at timestamptz;

CREATE OR REPLACE FUNCTION tokencapture.drop_snapshot(
    p_rollout text, p_snapshot_id text, p_version bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    r tokencapture.rollouts;
BEGIN
    SELECT * INTO r FROM tokencapture.rollouts WHERE rollout_id = p_rollout FOR UPDATE;
    IF NOT FOUND OR NOT r.frozen OR r.snapshot_id <> p_snapshot_id OR r.version <> p_version
    THEN
        RETURN false;
    END IF;
    IF NOT r.retired THEN
        UPDATE tokencapture.rollouts SET retired = true, retired_at = now()
            WHERE rollout_id = p_rollout;
    END IF;
    PERFORM tokencapture.remove_records(p_rollout);
    RETURN true;
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
    UPDATE tokencapture.rollouts SET retired = true, retired_at = now()
        WHERE rollout_id = ANY (p_rollouts) AND NOT retired;
    FOREACH id IN ARRAY p_rollouts LOOP
        IF tokencapture.remove_records(id) THEN
            removed := removed || id;
        ELSE
            absent := absent || id;
        END IF;
    END LOOP;
END
$$;

-- One rollout whole (status 0), or status 1 when it does not exist.
CREATE FUNCTION tokencapture.export_rollout(
    p_rollout text,
    OUT status smallint, OUT frozen boolean, OUT retired boolean, OUT incomplete boolean,
    OUT snapshot_id text, OUT version bigint, OUT retired_at timestamptz,
    OUT call_ids bytea[], OUT digests text[], OUT lines bytea[],
    OUT intents bytea[], OUT markers bytea[])
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    r tokencapture.rollouts;
BEGIN
    SELECT * INTO r FROM tokencapture.rollouts WHERE rollout_id = p_rollout;
    IF NOT FOUND THEN
        status := 1;
        RETURN;
    END IF;
    status := 0;
    frozen := r.frozen;
    retired := r.retired;
    incomplete := r.incomplete;
    snapshot_id := r.snapshot_id;
    version := r.version;
    retired_at := r.retired_at;
    SELECT coalesce(array_agg(e.model_call_id ORDER BY e.seq), '{}'),
           coalesce(array_agg(e.digest ORDER BY e.seq), '{}'),
           coalesce(array_agg(e.line ORDER BY e.seq), '{}')
        INTO call_ids, digests, lines
        FROM tokencapture.entries e WHERE e.rollout_id = p_rollout;
    SELECT coalesce(array_agg(i.model_call_id ORDER BY i.model_call_id), '{}') INTO intents
        FROM tokencapture.intents i WHERE i.rollout_id = p_rollout;
    SELECT coalesce(array_agg(m.marker ORDER BY m.seq), '{}') INTO markers
        FROM tokencapture.incomplete_marks m WHERE m.rollout_id = p_rollout;
END
$$;

-- Create one rollout whole; false (and nothing changes) when the id already has a row.
CREATE FUNCTION tokencapture.import_rollout(
    p_rollout text, p_frozen boolean, p_retired boolean, p_incomplete boolean,
    p_snapshot_id text, p_version bigint,
    p_call_ids bytea[], p_digests text[], p_lines bytea[],
    p_intents bytea[], p_markers bytea[])
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(p_lines) > p_version THEN
        RAISE EXCEPTION 'rollout % has % entries but version %: not a store''s state',
            p_rollout, cardinality(p_lines), p_version USING ERRCODE = 'data_exception';
    END IF;
    INSERT INTO tokencapture.rollouts
        (rollout_id, frozen, retired, incomplete, snapshot_id, version, retired_at)
        VALUES (p_rollout, p_frozen, p_retired, p_incomplete, p_snapshot_id, p_version,
                CASE WHEN p_retired THEN now() END)
        ON CONFLICT (rollout_id) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO tokencapture.entries (rollout_id, model_call_id, seq, digest, line)
        SELECT p_rollout, c, n, d, l
        FROM unnest(p_call_ids, p_digests, p_lines) WITH ORDINALITY AS t(c, d, l, n);
    INSERT INTO tokencapture.intents (rollout_id, model_call_id)
        SELECT p_rollout, i FROM unnest(p_intents) AS i ON CONFLICT DO NOTHING;
    INSERT INTO tokencapture.incomplete_marks (rollout_id, seq, marker)
        -- Non-positive: below every seq a later mark takes (version + 1).
        SELECT p_rollout, n - cardinality(p_markers), m
        FROM unnest(p_markers) WITH ORDINALITY AS t(m, n);
    RETURN true;
END
$$;
