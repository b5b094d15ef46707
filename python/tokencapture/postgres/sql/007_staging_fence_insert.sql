-- Schema version 7: a stage of a rollout new to the server inserts its fence row and takes no
-- row lock on it.
--
-- Version 5's stage_call looked the fence row up FOR KEY SHARE first and, for a new rollout
-- (every W1 stage of the staging benchmark), inserted it and looked it up again: three
-- statements and a row lock (a WAL record, the row's page dirtied again) before the staged
-- call's own insert. Inserting first is the same fence with one statement: a row this
-- transaction inserted is invisible to every other one until it commits, and a retire or
-- delete of that rollout that comes meanwhile conflicts with the insert (retire inserts the
-- row it locks, unique on rollout_id) and so waits for this transaction, exactly as it waits
-- for the KEY SHARE lock otherwise; a retire that committed first left its row, so the insert
-- does nothing and the lookup under the lock sees `retired`. Rollouts already known take the
-- lookup as before (the insert found the key in the index and did nothing).
CREATE OR REPLACE FUNCTION tokencapture.stage_call(
    p_rollout text, p_key text, p_digest text, p_row bytea, p_attachments bytea)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    fenced boolean := false;
    known text;
BEGIN
    INSERT INTO tokencapture.staging_rollouts (rollout_id) VALUES (p_rollout)
        ON CONFLICT (rollout_id) DO NOTHING;
    IF NOT FOUND THEN
        LOOP
            SELECT retired INTO fenced FROM tokencapture.staging_rollouts
                WHERE rollout_id = p_rollout FOR KEY SHARE;
            EXIT WHEN FOUND;
            -- Deleted (delete_staging) since the insert found it: insert it again.
            INSERT INTO tokencapture.staging_rollouts (rollout_id) VALUES (p_rollout)
                ON CONFLICT (rollout_id) DO NOTHING;
            EXIT WHEN FOUND;
        END LOOP;
    END IF;
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
