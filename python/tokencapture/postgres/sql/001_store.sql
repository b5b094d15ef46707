-- tokencapture schema version 1: the token capture store.
--
-- One row per rollout in `rollouts` (its lifecycle flags, snapshot id and version: the file
-- store's state index) and the rollout's records in three tables keyed by rollout id first, so
-- Citus can distribute every table by `rollout_id` and keep a rollout on one shard. Every
-- operation is one function call: it locks the rollout row FOR UPDATE (writers of one rollout
-- are serialized, different rollouts never wait on each other) and commits as one statement.
-- Functions that must keep a side effect and still report a refusal return a status instead of
-- raising (a raise would roll the side effect back).
--
-- Call ids and incomplete markers are stored as their UTF-8 bytes (`bytea`): a call id may hold
-- any character but a line break, NUL included, which `text` cannot hold.
--
-- Status codes: 0 done, 1 duplicate (same payload digest already stored), 2 conflict (the
-- rollout is now marked incomplete), 3 frozen, 4 retired.

CREATE SEQUENCE tokencapture.incarnations;

CREATE TABLE tokencapture.rollouts (
    rollout_id  text    PRIMARY KEY,
    -- A new incarnation for every row: readers that cache per rollout (lineage cursors) notice
    -- a rollout that was deleted and reused.
    incarnation bigint  NOT NULL DEFAULT nextval('tokencapture.incarnations'),
    frozen      boolean NOT NULL DEFAULT false,
    retired     boolean NOT NULL DEFAULT false,
    incomplete  boolean NOT NULL DEFAULT false,
    snapshot_id text    NOT NULL DEFAULT '',
    version     bigint  NOT NULL DEFAULT 0,
    -- When the fence was set (`tokencapture sweep` deletes fences older than a duration).
    retired_at  timestamptz
);

-- The canonical lines, byte for byte what the file store writes (without the newline), in
-- commit order (`seq` is the rollout's version right after the put).
CREATE TABLE tokencapture.entries (
    rollout_id    text   NOT NULL,
    model_call_id bytea  NOT NULL,
    seq           bigint NOT NULL,
    digest        text   NOT NULL,
    line          bytea  NOT NULL,
    PRIMARY KEY (rollout_id, model_call_id)
);
-- Uncompressed: pglz doubles the server's CPU per put and the fetch time of a rollout for ~7%
-- fewer bytes (measured on the 2-core development machine).
ALTER TABLE tokencapture.entries ALTER COLUMN line SET STORAGE EXTERNAL;

CREATE TABLE tokencapture.intents (
    rollout_id    text NOT NULL,
    model_call_id bytea NOT NULL,
    PRIMARY KEY (rollout_id, model_call_id)
);

-- One row per mark_incomplete: the line the file store appends to R.tokens.incomplete.
CREATE TABLE tokencapture.incomplete_marks (
    rollout_id text   NOT NULL,
    seq        bigint NOT NULL,
    marker     bytea  NOT NULL,
    PRIMARY KEY (rollout_id, seq)
);

-- The rollout row, locked FOR UPDATE; created (unfenced, empty) when it does not exist.
CREATE FUNCTION tokencapture.lock_rollout(p_rollout text)
RETURNS tokencapture.rollouts
LANGUAGE plpgsql AS $$
DECLARE
    r tokencapture.rollouts;
BEGIN
    LOOP
        SELECT * INTO r FROM tokencapture.rollouts WHERE rollout_id = p_rollout FOR UPDATE;
        IF FOUND THEN
            RETURN r;
        END IF;
        INSERT INTO tokencapture.rollouts (rollout_id) VALUES (p_rollout)
            ON CONFLICT (rollout_id) DO NOTHING;
    END LOOP;
END
$$;

CREATE FUNCTION tokencapture.put(p_rollout text, p_call bytea, p_digest text, p_line bytea)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    r tokencapture.rollouts;
    known text;
BEGIN
    r := tokencapture.lock_rollout(p_rollout);
    IF r.retired THEN RETURN 4; END IF;
    IF r.frozen THEN RETURN 3; END IF;
    SELECT digest INTO known FROM tokencapture.entries
        WHERE rollout_id = p_rollout AND model_call_id = p_call;
    IF FOUND THEN
        IF known = p_digest THEN RETURN 1; END IF;
        UPDATE tokencapture.rollouts SET incomplete = true, version = version + 1
            WHERE rollout_id = p_rollout;
        RETURN 2;
    END IF;
    INSERT INTO tokencapture.entries (rollout_id, model_call_id, seq, digest, line)
        VALUES (p_rollout, p_call, r.version + 1, p_digest, p_line);
    UPDATE tokencapture.rollouts SET version = version + 1 WHERE rollout_id = p_rollout;
    RETURN 0;
END
$$;

-- Puts that arrive together share one call and one commit. The client gathers the puts that
-- are waiting for a connection (at most a few dozen) into one call: one round trip, one WAL
-- flush and one function call for all of them, which is most of the cost of a put. Each put
-- keeps its own outcome (a status per put, as tokencapture.put returns); nothing is
-- acknowledged before the shared commit is flushed. Rollout rows are locked in rollout id
-- order, so concurrent batches never deadlock; puts of one rollout keep their order within
-- the batch.
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

CREATE FUNCTION tokencapture.begin_call(p_rollout text, p_call bytea)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    r tokencapture.rollouts;
BEGIN
    r := tokencapture.lock_rollout(p_rollout);
    IF r.retired THEN RETURN 4; END IF;
    IF r.frozen THEN RETURN 3; END IF;
    INSERT INTO tokencapture.intents (rollout_id, model_call_id) VALUES (p_rollout, p_call)
        ON CONFLICT DO NOTHING;
    RETURN 0;
END
$$;

CREATE FUNCTION tokencapture.mark_incomplete(p_rollout text, p_marker bytea)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    r tokencapture.rollouts;
BEGIN
    r := tokencapture.lock_rollout(p_rollout);
    IF r.retired THEN RETURN 4; END IF;
    INSERT INTO tokencapture.incomplete_marks (rollout_id, seq, marker)
        VALUES (p_rollout, r.version + 1, p_marker);
    UPDATE tokencapture.rollouts SET incomplete = true, version = version + 1
        WHERE rollout_id = p_rollout;
    RETURN 0;
END
$$;

-- Whether an intent of the rollout has no entry (a dangling intent masks the snapshot).
CREATE FUNCTION tokencapture.has_dangling_intent(p_rollout text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM tokencapture.intents i
        WHERE i.rollout_id = p_rollout
          AND NOT EXISTS (
              SELECT 1 FROM tokencapture.entries e
              WHERE e.rollout_id = p_rollout AND e.model_call_id = i.model_call_id))
$$;

-- Freeze (the first one takes `p_snapshot_id`, minted by the client) and return its outcome,
-- then the lines as rows: the first row carries the outcome and no line, every later row one
-- line (without its newline) and its payload digest, in commit order. The client joins the
-- lines into the log buffer the native decoder takes. Measured on a 24-call, 2.5 MB agentic
-- rollout (W2's shape): the log as one bytea value (or one array of lines) took ~10 ms to
-- reach the client, which assembles one 2.5 MB protocol message, where the same lines as 24
-- rows took ~2-3 ms; the server's aggregation itself cost ~1.5 ms.
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

-- The stored lines and their digests in commit order (nothing is created or changed).
CREATE FUNCTION tokencapture.read_lines(p_rollout text, OUT line bytea, OUT digest text)
RETURNS SETOF record
LANGUAGE sql STABLE AS $$
    SELECT e.line, e.digest FROM tokencapture.entries e
    WHERE e.rollout_id = p_rollout ORDER BY e.seq
$$;

CREATE FUNCTION tokencapture.is_incomplete(p_rollout text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT incomplete FROM tokencapture.rollouts WHERE rollout_id = p_rollout), false)
$$;

-- Remove the records of a rollout; whether it had any.
CREATE FUNCTION tokencapture.remove_records(p_rollout text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    had boolean := false;
BEGIN
    DELETE FROM tokencapture.entries WHERE rollout_id = p_rollout;
    GET DIAGNOSTICS n = ROW_COUNT;
    had := had OR n > 0;
    DELETE FROM tokencapture.intents WHERE rollout_id = p_rollout;
    GET DIAGNOSTICS n = ROW_COUNT;
    had := had OR n > 0;
    DELETE FROM tokencapture.incomplete_marks WHERE rollout_id = p_rollout;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN had OR n > 0;
END
$$;

-- Drop the consumed snapshot's records and keep the fence, only when the rollout is frozen
-- with exactly this snapshot id and version.
CREATE FUNCTION tokencapture.drop_snapshot(
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

-- Lock the rows of a batch (created when missing) in one order, so concurrent batches never
-- deadlock each other.
CREATE FUNCTION tokencapture.lock_batch(p_rollouts text[])
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO tokencapture.rollouts (rollout_id)
        SELECT id FROM unnest(p_rollouts) AS id ORDER BY id
        ON CONFLICT (rollout_id) DO NOTHING;
    PERFORM 1 FROM tokencapture.rollouts WHERE rollout_id = ANY (p_rollouts)
        ORDER BY rollout_id FOR UPDATE;
END
$$;

-- Fence every rollout of the batch and remove its records, in one transaction. Returns the
-- ids that had records and those that had none, in the batch's order.
CREATE FUNCTION tokencapture.retire(
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

-- Remove records and fences, so a reused id starts empty, in one transaction.
CREATE FUNCTION tokencapture.delete(p_rollouts text[], OUT removed text[], OUT absent text[])
LANGUAGE plpgsql AS $$
DECLARE
    id text;
    had boolean;
BEGIN
    removed := '{}';
    absent := '{}';
    PERFORM 1 FROM tokencapture.rollouts WHERE rollout_id = ANY (p_rollouts)
        ORDER BY rollout_id FOR UPDATE;
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

-- What `tokencapture copy` needs: the export and import functions move one rollout whole, byte
-- for byte, with its version, snapshot id, flags, intents and incomplete marks.

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
