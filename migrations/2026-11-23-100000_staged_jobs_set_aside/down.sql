ALTER TABLE staged_jobs
    DROP COLUMN last_error,
    DROP COLUMN parked_at,
    DROP COLUMN next_attempt_at,
    DROP COLUMN attempts;
