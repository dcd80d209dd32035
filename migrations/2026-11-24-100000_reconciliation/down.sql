DROP INDEX rides_created_at;
DROP TABLE reconciler_watermarks;
DROP TABLE reconciliation_findings;
