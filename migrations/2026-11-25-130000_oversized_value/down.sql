DELETE FROM reconciliation_findings WHERE kind = 'oversized_value';
ALTER TABLE reconciliation_findings DROP CONSTRAINT reconciliation_findings_kind_check;
ALTER TABLE reconciliation_findings ADD CONSTRAINT reconciliation_findings_kind_check
    CHECK (kind IN (
        'unrecorded_charge', 'unknown_ride', 'missing_charge', 'charge_not_succeeded',
        'amount_mismatch', 'currency_mismatch', 'refunded_charge'));
