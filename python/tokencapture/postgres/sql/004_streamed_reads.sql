-- tokencapture schema version 4: freezes and lineage reads whose lines stream.
--
-- A function called in FROM hands back its whole result at once: PostgreSQL stores every row
-- in a tuplestore before the first is sent. For a 2.5 MB rollout, freeze_lines (version 1)
-- spent about a quarter of its server time there, and lineage_tail (version 2) built an array
-- of the new lines. From this version:
--
-- * A freeze is `freeze_stream`, called in the select list (where a set-returning SQL
--   function gives its rows one at a time) from the client's one statement. Its first
--   statement locks the rollout row and marks the freeze; its second, which takes a fresh
--   snapshot because the function is VOLATILE, reads the outcome and the lines under that
--   lock, so it sees every put committed before the freeze and no put lands after it. The
--   commit follows the last row, before the client's call returns.
-- * lineage_lines is lineage_tail's answer as rows, from one inlined query.
--
-- The version 1 and 2 functions stay, so clients of an earlier version keep working during a
-- rolling upgrade.

-- Lock a rollout's row and, unless it is retired or frozen already, freeze it: the first
-- freeze records the snapshot id and bumps the version.
CREATE FUNCTION tokencapture.freeze_mark(p_rollout text, p_snapshot_id text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r tokencapture.rollouts;
BEGIN
    r := tokencapture.lock_rollout(p_rollout);
    IF NOT r.retired AND NOT r.frozen THEN
        UPDATE tokencapture.rollouts
            SET frozen = true, snapshot_id = p_snapshot_id, version = rollouts.version + 1
            WHERE rollout_id = p_rollout;
    END IF;
END
$$;

-- One row per line in commit order, each with the freeze's outcome (status 0, the incomplete
-- flag, snapshot id and version); a single row with a NULL line when the rollout has no lines;
-- a single row with status 4 (and nothing else) when it is retired.
CREATE TYPE tokencapture.frozen_line AS (
    status smallint, incomplete boolean, snapshot_id text, version bigint,
    line bytea, digest text);

CREATE FUNCTION tokencapture.freeze_stream(p_rollout text, p_snapshot_id text)
RETURNS SETOF tokencapture.frozen_line
LANGUAGE sql VOLATILE AS $$
    SELECT tokencapture.freeze_mark(p_rollout, p_snapshot_id);
    SELECT h.status, h.incomplete, h.snapshot_id, h.version, e.line, e.digest
    FROM (
        -- OFFSET 0: the outcome is computed once, not once per line.
        SELECT r.rollout_id, r.retired,
               CASE WHEN r.retired THEN 4 ELSE 0 END::smallint AS status,
               CASE WHEN NOT r.retired
                    THEN r.incomplete OR tokencapture.has_dangling_intent(p_rollout)
               END AS incomplete,
               CASE WHEN NOT r.retired THEN r.snapshot_id END AS snapshot_id,
               CASE WHEN NOT r.retired THEN r.version END AS version
        FROM tokencapture.rollouts r
        WHERE r.rollout_id = p_rollout
        OFFSET 0
    ) h
    LEFT JOIN tokencapture.entries e ON e.rollout_id = h.rollout_id AND NOT h.retired
    ORDER BY e.seq
$$;

-- The lines of a rollout committed past `p_after` (past 0 when its incarnation is not
-- `p_incarnation`: the id was deleted and reused), one row each in `seq` order, every row with
-- the rollout's incarnation and fence; one row with a NULL seq and line when nothing is new or
-- the rollout is retired (its lines are not read); no row when the rollout does not exist.
-- One statement, so the rollout row and the lines come from one snapshot.
CREATE FUNCTION tokencapture.lineage_lines(
    p_rollout text, p_incarnation bigint, p_after bigint,
    OUT incarnation bigint, OUT retired boolean, OUT seq bigint, OUT line bytea)
RETURNS SETOF record
LANGUAGE sql STABLE AS $$
    SELECT r.incarnation, r.retired, e.seq, e.line
    FROM tokencapture.rollouts r
    LEFT JOIN tokencapture.entries e
        ON e.rollout_id = r.rollout_id
        AND NOT r.retired
        AND e.seq > CASE WHEN r.incarnation = p_incarnation THEN p_after ELSE 0 END
    WHERE r.rollout_id = p_rollout
    ORDER BY e.seq
$$;
