-- A PaymentIntent whose id, currency or status is longer than the columns here allow is recorded
-- as `oversized_value` (its values cut to fit) instead of failing every reconciler pass on the
-- insert (docs/money-safety.md).
ALTER TABLE reconciliation_findings DROP CONSTRAINT reconciliation_findings_kind_check;
ALTER TABLE reconciliation_findings ADD CONSTRAINT reconciliation_findings_kind_check
    CHECK (kind IN (
        'unrecorded_charge', 'unknown_ride', 'missing_charge', 'charge_not_succeeded',
        'amount_mismatch', 'currency_mismatch', 'refunded_charge', 'oversized_value'));
