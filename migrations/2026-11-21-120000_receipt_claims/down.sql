ALTER TABLE sent_receipts DROP COLUMN recorded_via;
DROP TABLE receipt_claims;
