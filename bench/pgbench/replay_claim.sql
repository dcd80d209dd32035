-- A replay exactly as the api-server serves it (for comparison with replay_reads.sql): ONE
-- statement that authenticates and claims (the claim, api-server/src/rides/claim.sql); it finds the finished key and so
-- inserts nothing: no row lock, no transaction id, no WAL, no sequence value.
\set uid :user_base + :client_id
\set n random(1, :keys_per_user)
WITH caller AS (SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id, api_token_digest
    FROM users WHERE api_token_digest = sha256(convert_to('pgbench-token-' || :uid, 'UTF8'))),
  existing AS (SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id
    FROM idempotency_keys WHERE user_id = (SELECT id FROM caller) AND idempotency_key = 'pgbench-replay-key-' || :uid || '-' || :n),
  inserted AS (INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, request_method, request_path, request_params, recovery_point, locked_at)
    SELECT caller.id, 'pgbench-replay-key-' || :uid || '-' || :n, gen_random_uuid(), 'POST', '/rides.v1.RideService/CreateRide',
           '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb, 'started', now() FROM caller
    WHERE NOT EXISTS (SELECT FROM existing)
    ON CONFLICT (user_id, idempotency_key) DO NOTHING
    RETURNING id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id),
  found AS (SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id, true AS inserted FROM inserted
    UNION ALL SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id, false FROM existing)
SELECT caller.id AS caller_id, caller.created_at AS caller_created_at, caller.email, caller.stripe_customer_id, caller.stripe_payment_method_id, caller.api_token_digest,
       found.id AS key_id, found.created_at, found.idempotency_key, found.last_run_at, found.locked_at, found.lock_token AS tok, found.request_method, found.request_path,
       found.request_params, found.response_code, found.response_body, found.recovery_point, found.user_id, found.inserted
  FROM caller, found;
