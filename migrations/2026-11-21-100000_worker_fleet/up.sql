-- The worker fleet: receipt deduplication, the completer's per-key bookkeeping, and the list of
-- keys a human has to look at. Additive only: the api-server neither reads nor writes these.

-- One row per ride whose receipt was handed to the mail relay. The row is inserted in the same
-- transaction that is open while the mail is sent, so an uncommitted row doubles as a per-ride
-- lock (a concurrent duplicate waits on the primary key) and a failed send leaves no row.
CREATE TABLE sent_receipts (
    ride_id    BIGINT      PRIMARY KEY REFERENCES rides ON DELETE CASCADE,
    -- The AMQP message id (= staged job id) of the delivery that sent it, for tracing.
    message_id TEXT        NOT NULL CHECK (char_length(message_id) <= 255),
    sent_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The completer's retry state per key: attempts made, when the key may be tried next (also its
-- lease while a completer works it), and when it gave up and handed the key to a human.
ALTER TABLE idempotency_keys
    ADD COLUMN completer_attempts        INT         NOT NULL DEFAULT 0
        CHECK (completer_attempts >= 0),
    ADD COLUMN completer_next_attempt_at TIMESTAMPTZ,
    ADD COLUMN completer_gave_up_at      TIMESTAMPTZ;

-- The completer's scan: unfinished keys it has not given up on, oldest first.
CREATE INDEX idempotency_keys_completer_candidates
    ON idempotency_keys (created_at, id)
    WHERE recovery_point <> 'finished' AND completer_gave_up_at IS NULL;

-- Keys that automation could not finish, for an operator to list and resolve. Deliberately no
-- foreign key to idempotency_keys: the reaper deletes the key in the same transaction that
-- records it here, and this row must outlive it.
CREATE TABLE keys_needing_attention (
    id                 BIGSERIAL   PRIMARY KEY,
    recorded_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    reason             TEXT        NOT NULL
        CHECK (reason IN ('completer_gave_up', 'reaped_unfinished')),
    idempotency_key_id BIGINT      NOT NULL,
    user_id            BIGINT      NOT NULL REFERENCES users ON DELETE RESTRICT,
    idempotency_key    TEXT        NOT NULL CHECK (char_length(idempotency_key) <= 255),
    recovery_point     TEXT        NOT NULL
        CHECK (recovery_point IN ('started', 'ride_created', 'charge_created', 'finished')),
    request_params     JSONB       NOT NULL,
    last_error         TEXT        CHECK (char_length(last_error) <= 2000),
    resolved_at        TIMESTAMPTZ
);

-- What an operator lists: the open items, oldest first.
CREATE INDEX keys_needing_attention_open
    ON keys_needing_attention (recorded_at) WHERE resolved_at IS NULL;
CREATE INDEX keys_needing_attention_idempotency_key_id
    ON keys_needing_attention (idempotency_key_id);

-- Wakes idle enqueuers as soon as a job is committed (NOTIFY is delivered at commit, never for a
-- rolled-back transaction). Polling with back-off remains the safety net.
CREATE FUNCTION staged_jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('staged_jobs', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER staged_jobs_notify
    AFTER INSERT ON staged_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION staged_jobs_notify();
