-- Finishes each key with its stored outcome and nothing else (a declined card, a refunded
-- charge, an operator's `key finish --outcome declined`), and clears its lock. Fenced by the
-- holder's token (see `contract::writes`); a key whose fence fails comes back as no row.
WITH input AS (
    SELECT * FROM unnest(
        $key_ids::int8[], $tokens::uuid[], $user_ids::int8[],
        $response_codes::int4[], $response_bodies::jsonb[]
    ) AS i (key_id, token, user_id, response_code, response_body)
),
fence AS (
    SELECT input.*
    FROM (SELECT * FROM input ORDER BY key_id) input
    CROSS JOIN LATERAL (
        SELECT FROM idempotency_keys
        WHERE idempotency_keys.id = input.key_id
          AND idempotency_keys.lock_token = input.token
          AND idempotency_keys.user_id = input.user_id
        FOR NO KEY UPDATE
    ) locked
)
UPDATE idempotency_keys
SET recovery_point = 'finished',
    response_code = fence.response_code,
    response_body = fence.response_body,
    locked_at = NULL, lock_token = NULL, lock_holder = NULL
FROM fence
WHERE idempotency_keys.id = ANY($key_ids::int8[])
  AND idempotency_keys.id = fence.key_id
  AND idempotency_keys.user_id = fence.user_id
RETURNING idempotency_keys.id, fence.token
