-- tokencapture schema version 3: the capture ledger (PostgresCaptureLedger).
--
-- The rows are NeMo Gym 0.7.0's ledger rows, byte for byte as FileCaptureLedger writes them
-- (built by the same client code); the client also extracts what the server decides on: the
-- call id, whether the row is a failure row, whether the manifest lists it, and its fingerprint
-- when it can resolve (fingerprint version 2). One `ledger_rollouts` row per rollout carries
-- the fence and orders writers (locked FOR UPDATE); keyed by rollout id for Citus like the
-- store's tables.
--
-- record_ledger_row status: 0 stored, 1 already there (identical row), 2 conflict (nothing
-- written), 5 discarded (the rollout is retired).

CREATE TABLE tokencapture.ledger_rollouts (
    rollout_id text    PRIMARY KEY,
    retired    boolean NOT NULL DEFAULT false,
    retired_at timestamptz
);

CREATE TABLE tokencapture.ledger_rows (
    rollout_id    text    NOT NULL,
    seq           bigint  NOT NULL,
    model_call_id text    NOT NULL,
    failure       boolean NOT NULL,
    in_manifest   boolean NOT NULL,
    fingerprint   text,   -- set only on rows that can resolve (fingerprint_version 2)
    line          bytea   NOT NULL,
    PRIMARY KEY (rollout_id, seq)
);
ALTER TABLE tokencapture.ledger_rows ALTER COLUMN line SET STORAGE EXTERNAL;
CREATE INDEX ledger_rows_by_call ON tokencapture.ledger_rows (rollout_id, model_call_id, seq);
CREATE INDEX ledger_rows_by_fingerprint ON tokencapture.ledger_rows (rollout_id, fingerprint)
    WHERE fingerprint IS NOT NULL;

CREATE FUNCTION tokencapture.lock_ledger(p_rollout text)
RETURNS tokencapture.ledger_rollouts
LANGUAGE plpgsql AS $$
DECLARE
    r tokencapture.ledger_rollouts;
BEGIN
    LOOP
        SELECT * INTO r FROM tokencapture.ledger_rollouts WHERE rollout_id = p_rollout
            FOR UPDATE;
        IF FOUND THEN
            RETURN r;
        END IF;
        INSERT INTO tokencapture.ledger_rollouts (rollout_id) VALUES (p_rollout)
            ON CONFLICT (rollout_id) DO NOTHING;
    END LOOP;
END
$$;

CREATE FUNCTION tokencapture.record_ledger_row(
    p_rollout text, p_call text, p_failure boolean, p_in_manifest boolean,
    p_fingerprint text, p_line bytea)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    r tokencapture.ledger_rollouts;
    first_line bytea;
    next_seq bigint;
BEGIN
    r := tokencapture.lock_ledger(p_rollout);
    IF r.retired THEN RETURN 5; END IF;
    IF p_failure THEN
        -- A failure row is a no-op when the identical failure row exists.
        IF EXISTS (SELECT 1 FROM tokencapture.ledger_rows
                   WHERE rollout_id = p_rollout AND model_call_id = p_call AND failure
                     AND line = p_line) THEN
            RETURN 1;
        END IF;
    ELSE
        -- A commit row is compared with the first row of its call id.
        SELECT line INTO first_line FROM tokencapture.ledger_rows
            WHERE rollout_id = p_rollout AND model_call_id = p_call ORDER BY seq LIMIT 1;
        IF FOUND THEN
            IF first_line = p_line THEN RETURN 1; END IF;
            RETURN 2;
        END IF;
    END IF;
    SELECT coalesce(max(seq), 0) + 1 INTO next_seq FROM tokencapture.ledger_rows
        WHERE rollout_id = p_rollout;
    INSERT INTO tokencapture.ledger_rows
        (rollout_id, seq, model_call_id, failure, in_manifest, fingerprint, line)
        VALUES (p_rollout, next_seq, p_call, p_failure, p_in_manifest, p_fingerprint, p_line);
    RETURN 0;
END
$$;

-- retired: the rollout is fenced (reads raise); rows: the manifest's rows in order, or
-- every row's count when p_manifest is false (has_rows).
CREATE FUNCTION tokencapture.ledger_manifest(
    p_rollout text, OUT retired boolean, OUT row_count bigint, OUT lines bytea[])
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT l.retired FROM tokencapture.ledger_rollouts l
                     WHERE l.rollout_id = p_rollout), false),
           (SELECT count(*) FROM tokencapture.ledger_rows r WHERE r.rollout_id = p_rollout),
           coalesce((SELECT array_agg(r.line ORDER BY r.seq) FROM tokencapture.ledger_rows r
                     WHERE r.rollout_id = p_rollout AND r.in_manifest), '{}')
$$;

-- The only row that can resolve this fingerprint (NULL when none or several carry it).
CREATE FUNCTION tokencapture.ledger_candidate(p_rollout text, p_fingerprint text)
RETURNS bytea
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN count(*) = 1 THEN (array_agg(line))[1] END
    FROM (SELECT line FROM tokencapture.ledger_rows
          WHERE rollout_id = p_rollout AND fingerprint = p_fingerprint LIMIT 2) AS found
$$;

CREATE FUNCTION tokencapture.ledger_retire(
    p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
    n bigint;
BEGIN
    removed := '{}';
    absent := '{}';
    INSERT INTO tokencapture.ledger_rollouts (rollout_id)
        SELECT i FROM unnest(p_rollouts) AS i ORDER BY i ON CONFLICT DO NOTHING;
    PERFORM 1 FROM tokencapture.ledger_rollouts WHERE rollout_id = ANY (p_rollouts)
        ORDER BY rollout_id FOR UPDATE;
    UPDATE tokencapture.ledger_rollouts SET retired = true, retired_at = now()
        WHERE rollout_id = ANY (p_rollouts) AND NOT retired;
    FOREACH id IN ARRAY p_rollouts LOOP
        DELETE FROM tokencapture.ledger_rows WHERE rollout_id = id;
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n > 0 THEN removed := removed || id; ELSE absent := absent || id; END IF;
    END LOOP;
END
$$;

CREATE FUNCTION tokencapture.ledger_delete(
    p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
    n bigint;
    fenced boolean;
BEGIN
    removed := '{}';
    absent := '{}';
    PERFORM 1 FROM tokencapture.ledger_rollouts WHERE rollout_id = ANY (p_rollouts)
        ORDER BY rollout_id FOR UPDATE;
    FOREACH id IN ARRAY p_rollouts LOOP
        DELETE FROM tokencapture.ledger_rows WHERE rollout_id = id;
        GET DIAGNOSTICS n = ROW_COUNT;
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
