CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_unfinished_created_at
    ON idempotency_keys (created_at) WHERE recovery_point <> 'finished';
