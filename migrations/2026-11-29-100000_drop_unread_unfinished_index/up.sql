-- `idempotency_keys_unfinished_created_at` was the completer's index until the worker fleet's
-- migration gave it `idempotency_keys_completer_candidates` ((created_at, id) over unfinished keys
-- not given up on). No statement has read it since, and every CreateRide still paid for it: one
-- more index entry per new key, one more index opened and locked by every claim statement. The
-- reaper retires keys by `idempotency_keys_created_at`. CONCURRENTLY (outside a transaction, see
-- metadata.toml): the drop must not queue CreateRide's writes behind an exclusive lock.
DROP INDEX CONCURRENTLY IF EXISTS idempotency_keys_unfinished_created_at;
