-- The soak's end (bench/soak.sh), once drained: what every invariant is judged on. psql
-- variables: mail_files (receipts the mail sink wrote). One JSON object on one line.
SELECT json_build_object(
  'rides', (SELECT count(*) FROM rides),
  'rides_uncharged', (SELECT count(*) FROM rides WHERE stripe_charge_id IS NULL),
  'charges_on_two_rides', (SELECT count(*) FROM (SELECT stripe_charge_id FROM rides
      WHERE stripe_charge_id IS NOT NULL GROUP BY 1 HAVING count(*) > 1) AS twice),
  'rides_without_receipt', (SELECT count(*) FROM rides r
      WHERE NOT EXISTS (SELECT 1 FROM sent_receipts s WHERE s.ride_id = r.id)),
  'receipts_sent', (SELECT count(*) FROM sent_receipts),
  'mail_files', :mail_files,
  'unfinished_keys', (SELECT count(*) FROM idempotency_keys WHERE recovery_point <> 'finished'),
  'staged_jobs', (SELECT count(*) FROM staged_jobs),
  'attention_open', (SELECT count(*) FROM keys_needing_attention WHERE resolved_at IS NULL),
  'findings', (SELECT count(*) FROM reconciliation_findings),
  'findings_by_kind', (SELECT coalesce(json_object_agg(kind, n), '{}') FROM
      (SELECT kind, count(*) AS n FROM reconciliation_findings GROUP BY kind) AS k)
);
