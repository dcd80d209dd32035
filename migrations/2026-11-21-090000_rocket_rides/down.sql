DROP TABLE staged_jobs;
DROP TABLE rides;
DROP TABLE audit_records;
DROP TABLE idempotency_keys;
DROP TABLE users;
