DROP TRIGGER staged_jobs_notify ON staged_jobs;
DROP FUNCTION staged_jobs_notify();
DROP TABLE keys_needing_attention;
DROP INDEX idempotency_keys_completer_candidates;
ALTER TABLE idempotency_keys
    DROP COLUMN completer_gave_up_at,
    DROP COLUMN completer_next_attempt_at,
    DROP COLUMN completer_attempts;
DROP TABLE sent_receipts;
