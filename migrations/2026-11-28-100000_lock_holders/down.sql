DROP FUNCTION IF EXISTS idempotency_lock_state(TIMESTAMPTZ, BIGINT, TIMESTAMPTZ, DOUBLE PRECISION, DOUBLE PRECISION);
DROP FUNCTION IF EXISTS lock_holder_is_gone(BIGINT);
DROP TRIGGER IF EXISTS forget_lock_holder_for_servers_without_holders ON idempotency_keys;
DROP FUNCTION IF EXISTS forget_lock_holder_for_servers_without_holders();
ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_holder_needs_lock;
ALTER TABLE idempotency_keys DROP COLUMN IF EXISTS lock_holder;
