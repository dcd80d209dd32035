-- Rocket Rides: the schema of "Implementing Stripe-like Idempotency Keys in Postgres", with the
-- changes this service needs. Every constraint here is a second line of defence behind the code:
-- a bug must fail loudly in the database rather than charge twice or lose a ride.

CREATE TABLE users (
    id                       BIGSERIAL   PRIMARY KEY,
    created_at               TIMESTAMPTZ NOT NULL DEFAULT now(),
    email                    TEXT        NOT NULL UNIQUE
        CHECK (char_length(email) BETWEEN 3 AND 255),
    -- Stripe customer with an attached, off-session-capable payment method.
    stripe_customer_id       TEXT        NOT NULL UNIQUE
        CHECK (char_length(stripe_customer_id) BETWEEN 1 AND 255),
    stripe_payment_method_id TEXT        NOT NULL
        CHECK (char_length(stripe_payment_method_id) BETWEEN 1 AND 255),
    -- SHA-256 of the user's API token. The token itself is never stored.
    api_token_digest         BYTEA       NOT NULL UNIQUE
        CHECK (octet_length(api_token_digest) = 32)
);

CREATE TABLE idempotency_keys (
    id              BIGSERIAL   PRIMARY KEY,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    idempotency_key TEXT        NOT NULL
        CHECK (char_length(idempotency_key) BETWEEN 20 AND 255),
    last_run_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Set while an attempt owns the key. `lock_token` is the fencing token: every atomic phase
    -- re-checks it in its own transaction, so an attempt whose lock was taken over commits nothing.
    locked_at       TIMESTAMPTZ,
    lock_token      UUID,
    request_method  TEXT        NOT NULL CHECK (char_length(request_method) <= 10),
    request_path    TEXT        NOT NULL CHECK (char_length(request_path) <= 100),
    request_params  JSONB       NOT NULL,
    -- The stored final outcome (gRPC status code and a JSON document the response is rebuilt
    -- from), present exactly when the key is finished.
    response_code   INT,
    response_body   JSONB,
    recovery_point  TEXT        NOT NULL
        CHECK (recovery_point IN ('started', 'ride_created', 'charge_created', 'finished')),
    user_id         BIGINT      NOT NULL REFERENCES users ON DELETE RESTRICT,

    CONSTRAINT idempotency_keys_lock_is_whole
        CHECK ((locked_at IS NULL) = (lock_token IS NULL)),
    CONSTRAINT idempotency_keys_finished_has_response
        CHECK ((recovery_point = 'finished') = (response_code IS NOT NULL AND response_body IS NOT NULL)),
    CONSTRAINT idempotency_keys_finished_is_unlocked
        CHECK (recovery_point <> 'finished' OR locked_at IS NULL)
);

-- Keys are scoped per user: the claim's INSERT … ON CONFLICT arbitrates on this index.
CREATE UNIQUE INDEX idempotency_keys_user_id_idempotency_key
    ON idempotency_keys (user_id, idempotency_key);
-- The reaper retires keys by age.
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
-- The completer looks only at unfinished keys, oldest first.
CREATE INDEX idempotency_keys_unfinished_created_at
    ON idempotency_keys (created_at) WHERE recovery_point <> 'finished';

CREATE TABLE audit_records (
    id            BIGSERIAL   PRIMARY KEY,
    action        TEXT        NOT NULL CHECK (char_length(action) <= 50),
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    data          JSONB       NOT NULL,
    origin_ip     CIDR        NOT NULL,
    resource_id   BIGINT      NOT NULL,
    resource_type TEXT        NOT NULL CHECK (char_length(resource_type) <= 50),
    user_id       BIGINT      NOT NULL REFERENCES users ON DELETE RESTRICT
);

CREATE TABLE rides (
    id                 BIGSERIAL   PRIMARY KEY,
    created_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Keys are reaped after their TTL; the ride stays.
    idempotency_key_id BIGINT      REFERENCES idempotency_keys ON DELETE SET NULL,
    -- DOUBLE PRECISION rather than the seed's NUMERIC(13, 10): the API speaks doubles, and a
    -- ride must read back exactly as it was requested.
    origin_lat         DOUBLE PRECISION NOT NULL CHECK (origin_lat BETWEEN -90 AND 90),
    origin_lon         DOUBLE PRECISION NOT NULL CHECK (origin_lon BETWEEN -180 AND 180),
    target_lat         DOUBLE PRECISION NOT NULL CHECK (target_lat BETWEEN -90 AND 90),
    target_lon         DOUBLE PRECISION NOT NULL CHECK (target_lon BETWEEN -180 AND 180),
    -- The price is fixed when the ride is created, so a price change never alters a charge that
    -- is being retried.
    amount             BIGINT      NOT NULL CHECK (amount > 0),
    currency           TEXT        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    -- Stripe PaymentIntent id (pi_…); NULL until the charge is recorded.
    stripe_charge_id   TEXT        UNIQUE CHECK (char_length(stripe_charge_id) <= 255),
    user_id            BIGINT      NOT NULL REFERENCES users ON DELETE RESTRICT,

    -- One ride per key, ever (NULLs are distinct, so reaped keys do not collide).
    CONSTRAINT rides_idempotency_key_id_unique UNIQUE (idempotency_key_id)
);

CREATE INDEX rides_user_id ON rides (user_id);

-- Jobs written in the same transaction as the business data and moved to RabbitMQ by the
-- enqueuer only once committed.
CREATE TABLE staged_jobs (
    id            BIGSERIAL   PRIMARY KEY,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    job_name      TEXT        NOT NULL CHECK (char_length(job_name) <= 100),
    job_args      JSONB       NOT NULL,
    -- W3C trace context (traceparent, tracestate) the job was staged under.
    trace_context JSONB       NOT NULL DEFAULT '{}'
);
