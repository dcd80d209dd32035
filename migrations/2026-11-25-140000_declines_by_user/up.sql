-- The decline budget counts a user's recent card declines from the keys themselves, so that it
-- holds across every api-server replica (api_server::admission::declines). Only declined keys are
-- indexed: the index stays a small fraction of the table, and a count reads only the user's
-- declines inside the window. CONCURRENTLY (outside a transaction, see metadata.toml): building it
-- must not block CreateRide's writes on a large table.
CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_declines_by_user
    ON idempotency_keys (user_id, last_run_at)
    WHERE response_body ->> 'outcome' = 'card_declined';
