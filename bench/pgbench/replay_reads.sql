-- The reads a replay of a finished key needs: authenticate (users by token digest) and read the
-- finished key with its stored response (by the (user_id, idempotency_key) unique index).
-- This is the ceiling the replay goal is stated against. Keys 'pgbench-replay-key-<uid>-<n>' for
-- n in 1..:keys_per_user are seeded finished by bench/run.sh.
\set uid :user_base + :client_id
\set n random(1, :keys_per_user)
SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id, api_token_digest
  FROM users WHERE api_token_digest = sha256(convert_to('pgbench-token-' || :uid, 'UTF8')) LIMIT 1;
SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path,
       request_params, response_code, response_body, recovery_point, user_id
  FROM idempotency_keys WHERE user_id = :uid AND idempotency_key = 'pgbench-replay-key-' || :uid || '-' || :n LIMIT 1;
