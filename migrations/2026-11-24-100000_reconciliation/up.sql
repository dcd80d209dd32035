-- The reconciler (`workers reconciler`, docs/workers.md) compares the provider's PaymentIntents
-- with the rides, window by window, and records every disagreement here once: a charge no ride
-- records, a ride whose charge the provider does not have or did not take, an amount or a currency
-- that differs. A human resolves each one (`workers admin findings …`); a charge with no ride and
-- no live key may be refunded, only on an explicit request.
CREATE TABLE reconciliation_findings (
    id                  BIGSERIAL   PRIMARY KEY,
    kind                TEXT        NOT NULL CHECK (kind IN (
        'unrecorded_charge', 'unknown_ride', 'missing_charge', 'charge_not_succeeded',
        'amount_mismatch', 'currency_mismatch')),
    -- The PaymentIntent the finding is about: the provider's, or the one a ride records.
    payment_intent_id   TEXT        NOT NULL CHECK (char_length(payment_intent_id) <= 255),
    -- No foreign keys: a finding is evidence and must outlive whatever it names (a ride id from
    -- the provider's metadata may name no ride at all; keys are reaped).
    ride_id             BIGINT,
    user_id             BIGINT,
    idempotency_key_id  BIGINT,
    -- What the provider said; NULL when it has no such PaymentIntent. (16 columns: Diesel's table
    -- limit; the finding's description is rendered from them.)
    provider_amount     BIGINT,
    provider_currency   TEXT        CHECK (char_length(provider_currency) <= 16),
    provider_status     TEXT        CHECK (char_length(provider_status) <= 64),
    -- What the ride says; NULL when there is no ride.
    ride_amount         BIGINT,
    ride_currency       TEXT        CHECK (char_length(ride_currency) <= 16),
    first_seen_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_seen_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    resolved_at         TIMESTAMPTZ,
    resolution          TEXT        CHECK (char_length(resolution) <= 2000),
    -- The provider's refund (re_…), once one was made for this finding.
    refund_id           TEXT        CHECK (char_length(refund_id) <= 255),
    -- A finding is resolved with a reason, and a refund resolves it.
    CONSTRAINT reconciliation_findings_resolution CHECK ((resolved_at IS NULL) = (resolution IS NULL)),
    CONSTRAINT reconciliation_findings_refund_resolves CHECK (refund_id IS NULL OR resolved_at IS NOT NULL),
    -- Each mismatch is recorded once: a later pass that sees it again only moves last_seen_at.
    CONSTRAINT reconciliation_findings_once UNIQUE (kind, payment_intent_id)
);

-- What an operator lists and the metric counts: the open findings.
CREATE INDEX reconciliation_findings_open
    ON reconciliation_findings (first_seen_at) WHERE resolved_at IS NULL;

-- One row per reconciler: how far its windows are reconciled. Its row lock is also what keeps two
-- passes of the same reconciler from running at once (the second skips).
CREATE TABLE reconciler_watermarks (
    name              TEXT        PRIMARY KEY CHECK (char_length(name) <= 100),
    -- Everything created before this has been compared (less the overlap each pass re-reads).
    reconciled_until  TIMESTAMPTZ NOT NULL,
    -- Charges of keys still live when last seen (the completer may yet record them): the next
    -- pass looks each one up again by id, so the watermark need not wait for them.
    pending_payment_intents TEXT[] NOT NULL DEFAULT '{}',
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The reconciler reads a window of rides by creation time. One more index entry per CreateRide;
-- without it every pass would scan the whole table.
CREATE INDEX rides_created_at ON rides (created_at);
