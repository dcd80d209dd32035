-- Releases each key's lock, fenced by its token: the key is left where it stands, for a retry
-- (or the completer) to resume at once. A key whose lock was taken over meanwhile, or that is
-- finished (a finished key holds no lock), is not matched and comes back as no row.
WITH input AS (
    SELECT * FROM unnest($key_ids::int8[], $tokens::uuid[], $user_ids::int8[])
        AS i (key_id, token, user_id)
)
UPDATE idempotency_keys
SET locked_at = NULL, lock_token = NULL, lock_holder = NULL
FROM input
WHERE idempotency_keys.id = ANY($key_ids::int8[])
  AND idempotency_keys.id = input.key_id
  AND idempotency_keys.lock_token = input.token
  AND idempotency_keys.user_id = input.user_id
RETURNING idempotency_keys.id, input.token
