-- Every refund the service makes (`workers reconciler --refund`, `workers admin findings refund`),
-- written in the transaction that records it on its finding, so a refund made is a refund
-- audited (docs/money-safety.md). Who or what asked is `requested_by`: `reconciler --refund`, or
-- `operator:<name>` as the operator gave it. Rows are never updated or deleted.
CREATE TABLE refund_audits (
    id                BIGSERIAL   PRIMARY KEY,
    finding_id        BIGINT      NOT NULL REFERENCES reconciliation_findings ON DELETE RESTRICT,
    payment_intent_id TEXT        NOT NULL CHECK (char_length(payment_intent_id) <= 255),
    refund_id         TEXT        NOT NULL CHECK (char_length(refund_id) <= 255),
    amount            BIGINT      NOT NULL CHECK (amount > 0),
    currency          TEXT        NOT NULL CHECK (char_length(currency) <= 16),
    -- Why: the finding's kind and description (the provider is told `duplicate`).
    reason            TEXT        NOT NULL CHECK (char_length(reason) BETWEEN 1 AND 2000),
    requested_by      TEXT        NOT NULL CHECK (char_length(requested_by) BETWEEN 1 AND 200),
    deployment_id     TEXT        NOT NULL CHECK (char_length(deployment_id) <= 24),
    refunded_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- One refund per finding (the refund's provider key is the finding's).
    CONSTRAINT refund_audits_once UNIQUE (finding_id)
);
