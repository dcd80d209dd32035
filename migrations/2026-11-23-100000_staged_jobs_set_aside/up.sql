-- A staged job the broker returned as unroutable (no queue bound for its job name yet) or refused
-- is set aside with a back-off instead of being selected again at once: otherwise a handful of
-- such jobs at the head of the table, selected oldest first, would fill every batch and stop the
-- jobs behind them. After ENQUEUER_MAX_ATTEMPTS it is parked for a human (`workers admin
-- backlog` lists it; docs/operations.md says how to put it back). It is never deleted unsent.
ALTER TABLE staged_jobs
    -- Publications the broker returned or refused.
    ADD COLUMN attempts        INT         NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- NULL for a job never set aside (every job the api-server stages): due at once.
    ADD COLUMN next_attempt_at TIMESTAMPTZ,
    -- Set when the enqueuer gave up on the job; it is not selected again until a human clears it.
    ADD COLUMN parked_at       TIMESTAMPTZ,
    ADD COLUMN last_error      TEXT        CHECK (char_length(last_error) <= 2000);

-- No new index on purpose. The enqueuer's select (`WHERE parked_at IS NULL AND (next_attempt_at
-- IS NULL OR next_attempt_at <= now()) ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`) walks the
-- primary key in id order and checks the two columns on rows it visits anyway; in the common case
-- (nothing set aside) it is the same plan as before. An index on next_attempt_at cannot serve
-- ORDER BY id, and a partial index of the due jobs would add a second index insert to every
-- CreateRide commit to speed up only the case of set-aside jobs, which are few and alerted on.
