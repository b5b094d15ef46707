-- Citus body for schema version 4 (applied on a Citus deployment right after
-- 004_lineage_rows.sql; see sql/citus/001_store.sql for why it differs from the plain body).
-- The same rows, in the same order, from one query (one snapshot).

CREATE OR REPLACE FUNCTION tokencapture.lineage_lines(
    p_rollout text, p_incarnation bigint, p_after bigint,
    OUT incarnation bigint, OUT retired boolean, OUT seq bigint, OUT line bytea)
RETURNS SETOF record
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY
        SELECT r.incarnation, r.retired, e.seq, e.line
        FROM tokencapture.rollouts r
        LEFT JOIN tokencapture.entries e
            ON e.rollout_id = r.rollout_id
            AND NOT r.retired
            AND e.seq > CASE WHEN r.incarnation = p_incarnation THEN p_after ELSE 0 END
        WHERE r.rollout_id = p_rollout
        ORDER BY e.seq;
END
$$;
