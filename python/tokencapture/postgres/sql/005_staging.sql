-- tokencapture schema version 5: worker-owned staging (tokencapture.postgres.PostgresStagingStore).
--
-- A staged call is stored as the bytes every staging backend stores (the row and the
-- attachments blob of tokencapture._core.staging_encode, verified before they are sent and
-- again when they are read), keyed by rollout id first so Citus keeps a rollout's calls on one
-- shard, beside the fence of its rollout. The bodies are PL/pgSQL and lock one rollout at a
-- time, so the same bodies serve a plain server and a Citus cluster.
--
-- Locking: a stage holds its rollout's fence row FOR KEY SHARE (stages of one rollout run side
-- by side); retire and delete take it FOR UPDATE, so they wait for stages in flight and a stage
-- that comes after them sees the fence (or the missing row) they committed.
--
-- Status codes of a stage: 0 stored, 1 duplicate (the same content already stored), 2 conflict
-- (the key is stored with other content), 4 retired (the same numbers as the token store's).

CREATE TABLE tokencapture.staging_rollouts (
    rollout_id text        PRIMARY KEY,
    retired    boolean     NOT NULL DEFAULT false,
    retired_at timestamptz
);

CREATE TABLE tokencapture.staged_calls (
    rollout_id     text        NOT NULL,
    staging_key    text        COLLATE "C" NOT NULL,
    -- SHA-256 of row and attachments (StagedRow.content_digest): what idempotency compares.
    content_digest text        NOT NULL,
    row_bytes      bytea       NOT NULL,
    -- NULL when the call was staged without attachments.
    attachments    bytea,
    staged_at      timestamptz NOT NULL DEFAULT now(),
    -- Unique by key, as in the file store: two rollouts whose ids split one key differently
    -- ('a' + 'b/c', 'a/b' + 'c') cannot both stage it. The one index serves fetches (by key: a
    -- key's rollout id cannot be split off it) and a rollout's rows too: its keys are exactly
    -- those in [rollout_id || '/', rollout_id || '0') in byte order ('0' follows '/'), which
    -- the "C" collation makes the index's order. (On Citus the key is (staging_key,
    -- rollout_id): sql/citus/005_staging.sql.)
    PRIMARY KEY (staging_key)
);
-- The rows are verified token data with little redundancy: compression costs CPU for little.
-- A W1 row (320 tokens) is ~5.6 kB: kept in the heap page rather than cut into TOAST chunks
-- (three more tuples and index entries per stage) up to the largest target PostgreSQL allows.
ALTER TABLE tokencapture.staged_calls ALTER COLUMN row_bytes SET STORAGE EXTERNAL;
ALTER TABLE tokencapture.staged_calls ALTER COLUMN attachments SET STORAGE EXTERNAL;
ALTER TABLE tokencapture.staged_calls SET (toast_tuple_target = 8160);

-- One stage: fence checked under the rollout's KEY SHARE lock, then the row stored once.
CREATE FUNCTION tokencapture.stage_call(
    p_rollout text, p_key text, p_digest text, p_row bytea, p_attachments bytea)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    fenced boolean;
    known text;
BEGIN
    LOOP
        SELECT retired INTO fenced FROM tokencapture.staging_rollouts
            WHERE rollout_id = p_rollout FOR KEY SHARE;
        EXIT WHEN FOUND;
        INSERT INTO tokencapture.staging_rollouts (rollout_id) VALUES (p_rollout)
            ON CONFLICT (rollout_id) DO NOTHING;
    END LOOP;
    IF fenced THEN RETURN 4; END IF;
    INSERT INTO tokencapture.staged_calls
        (rollout_id, staging_key, content_digest, row_bytes, attachments)
        VALUES (p_rollout, p_key, p_digest, p_row, p_attachments)
        ON CONFLICT DO NOTHING;
    IF FOUND THEN RETURN 0; END IF;
    -- Not stored: the key is there, of this rollout (the same content or not) or of another.
    SELECT content_digest INTO known FROM tokencapture.staged_calls
        WHERE rollout_id = p_rollout AND staging_key = p_key;
    IF known = p_digest THEN RETURN 1; END IF;
    RETURN 2;
END
$$;

-- Stages that arrive together share one call and one commit (the client gathers the stages
-- waiting for a connection); each keeps its own status. Rollouts are locked in id order.
-- (Version 6 replaces it: a rollout's stages in key order too, see 006_staging_key_order.sql.)
CREATE FUNCTION tokencapture.stage_batch(
    p_rollouts text[], p_keys text[], p_digests text[], p_rows bytea[], p_attachments bytea[])
RETURNS smallint[]
LANGUAGE plpgsql AS $$
DECLARE
    statuses smallint[] := array_fill(0::smallint, ARRAY[cardinality(p_rollouts)]);
    i integer;
BEGIN
    FOR i IN
        SELECT n FROM unnest(p_rollouts) WITH ORDINALITY AS t(id, n) ORDER BY id, n
    LOOP
        statuses[i] := tokencapture.stage_call(
            p_rollouts[i], p_keys[i], p_digests[i], p_rows[i], p_attachments[i]);
    END LOOP;
    RETURN statuses;
END
$$;

-- Lock one rollout's fence row FOR UPDATE (created unfenced when missing).
CREATE FUNCTION tokencapture.lock_staging_rollout(p_rollout text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        PERFORM 1 FROM tokencapture.staging_rollouts WHERE rollout_id = p_rollout FOR UPDATE;
        EXIT WHEN FOUND;
        INSERT INTO tokencapture.staging_rollouts (rollout_id) VALUES (p_rollout)
            ON CONFLICT (rollout_id) DO NOTHING;
    END LOOP;
END
$$;

-- Fence rollouts and remove their staged calls, in one transaction; `removed` are those that
-- had staged calls, in the batch's order (the file store's answer). Rollouts are locked one at
-- a time in id order (Citus: FOR UPDATE needs equality on the distribution column).
CREATE FUNCTION tokencapture.retire_staging(
    p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
BEGIN
    removed := '{}';
    absent := '{}';
    FOR id IN SELECT DISTINCT u FROM unnest(p_rollouts) AS u ORDER BY u LOOP
        PERFORM tokencapture.lock_staging_rollout(id);
    END LOOP;
    FOREACH id IN ARRAY p_rollouts LOOP
        UPDATE tokencapture.staging_rollouts SET retired = true, retired_at = now()
            WHERE rollout_id = id AND NOT retired;
        DELETE FROM tokencapture.staged_calls
            WHERE rollout_id = id AND staging_key >= id || '/' AND staging_key < id || '0';
        IF FOUND THEN
            removed := removed || id;
        ELSE
            absent := absent || id;
        END IF;
    END LOOP;
END
$$;

-- Remove rollouts' staged calls and fences, so an id can be staged again; `removed` are those
-- that had staged calls or a fence.
CREATE FUNCTION tokencapture.delete_staging(
    p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
    had boolean;
BEGIN
    removed := '{}';
    absent := '{}';
    FOR id IN SELECT DISTINCT u FROM unnest(p_rollouts) AS u ORDER BY u LOOP
        PERFORM 1 FROM tokencapture.staging_rollouts WHERE rollout_id = id FOR UPDATE;
    END LOOP;
    FOREACH id IN ARRAY p_rollouts LOOP
        DELETE FROM tokencapture.staged_calls
            WHERE rollout_id = id AND staging_key >= id || '/' AND staging_key < id || '0';
        had := FOUND;
        DELETE FROM tokencapture.staging_rollouts WHERE rollout_id = id AND retired;
        IF had OR FOUND THEN
            removed := removed || id;
        ELSE
            absent := absent || id;
        END IF;
        DELETE FROM tokencapture.staging_rollouts WHERE rollout_id = id;
    END LOOP;
END
$$;

-- Also in version 5, for the token store: `sweep_retired` as a function that locks one rollout
-- at a time (its single statement of version 1 locks every candidate with one FOR UPDATE,
-- which Citus refuses: FOR UPDATE needs equality on the distribution column). The candidates
-- are read first, then each is locked in id order and checked again (a rollout deleted and
-- reused meanwhile is not retired any more and is left alone); the locked ones are deleted
-- (`delete`'s removals) unless `p_dry_run`. Ages are compared in float8 seconds, so infinite
-- ages stay exact.
CREATE FUNCTION tokencapture.sweep_retired(p_age float8, p_dry_run boolean)
RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    id text;
    swept text[] := '{}';
BEGIN
    FOR id IN
        SELECT rollout_id FROM tokencapture.rollouts
        WHERE retired AND extract(epoch FROM now() - retired_at)::float8 >= p_age
        ORDER BY rollout_id
    LOOP
        PERFORM 1 FROM tokencapture.rollouts
            WHERE rollout_id = id AND retired
              AND extract(epoch FROM now() - retired_at)::float8 >= p_age
            FOR UPDATE;
        IF FOUND THEN
            swept := swept || id;
        END IF;
    END LOOP;
    IF p_dry_run OR cardinality(swept) = 0 THEN
        RETURN swept;
    END IF;
    RETURN (SELECT d.removed FROM tokencapture.delete(swept) AS d);
END
$$;
