-- Citus bodies for schema version 3 (applied on a Citus deployment right after 003_ledger.sql;
-- see sql/citus/001_store.sql for why they differ from the plain bodies).

CREATE OR REPLACE FUNCTION tokencapture.ledger_manifest(
    p_rollout text, OUT retired boolean, OUT row_count bigint, OUT lines bytea[])
LANGUAGE plpgsql STABLE AS $$
BEGIN
    SELECT l.retired INTO retired FROM tokencapture.ledger_rollouts l
        WHERE l.rollout_id = p_rollout;
    retired := coalesce(retired, false);
    SELECT count(*) INTO row_count FROM tokencapture.ledger_rows r
        WHERE r.rollout_id = p_rollout;
    SELECT coalesce(array_agg(r.line ORDER BY r.seq), '{}') INTO lines
        FROM tokencapture.ledger_rows r WHERE r.rollout_id = p_rollout AND r.in_manifest;
END
$$;

CREATE OR REPLACE FUNCTION tokencapture.ledger_candidate(p_rollout text, p_fingerprint text)
RETURNS bytea
LANGUAGE plpgsql STABLE AS $$
DECLARE
    found_lines bytea[];
BEGIN
    SELECT array_agg(f.line) INTO found_lines
        FROM (SELECT r.line FROM tokencapture.ledger_rows r
              WHERE r.rollout_id = p_rollout AND r.fingerprint = p_fingerprint LIMIT 2) AS f;
    IF cardinality(found_lines) = 1 THEN
        RETURN found_lines[1];
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION tokencapture.ledger_retire(
    p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
    n bigint;
BEGIN
    removed := '{}';
    absent := '{}';
    FOR id IN SELECT DISTINCT u FROM unnest(p_rollouts) AS u ORDER BY u LOOP
        PERFORM tokencapture.lock_ledger(id);
    END LOOP;
    FOREACH id IN ARRAY p_rollouts LOOP
        UPDATE tokencapture.ledger_rollouts SET retired = true, retired_at = now()
            WHERE rollout_id = id AND NOT retired;
        DELETE FROM tokencapture.ledger_rows WHERE rollout_id = id;
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n > 0 THEN removed := removed || id; ELSE absent := absent || id; END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION tokencapture.ledger_delete(
    p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
    n bigint;
    fenced boolean;
BEGIN
    removed := '{}';
    absent := '{}';
    FOR id IN SELECT DISTINCT u FROM unnest(p_rollouts) AS u ORDER BY u LOOP
        PERFORM 1 FROM tokencapture.ledger_rollouts WHERE rollout_id = id FOR UPDATE;
    END LOOP;
    FOREACH id IN ARRAY p_rollouts LOOP
        DELETE FROM tokencapture.ledger_rows WHERE rollout_id = id;
        GET DIAGNOSTICS n = ROW_COUNT;
        fenced := NULL;
        DELETE FROM tokencapture.ledger_rollouts WHERE rollout_id = id RETURNING retired
            INTO fenced;
        IF n > 0 OR coalesce(fenced, false) THEN
            removed := removed || id;
        ELSE
            absent := absent || id;
        END IF;
    END LOOP;
END
$$;
