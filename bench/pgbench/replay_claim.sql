-- A replay exactly as the api-server serves it (for comparison with replay_reads.sql): auth
-- read; the claim's autocommit INSERT ... ON CONFLICT DO NOTHING (which conflicts and inserts
-- nothing); the plain read of the finished key that decides the replay. No row lock, no commit
-- record.
\set uid :user_base + :client_id
\set n random(1, :keys_per_user)
SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id, api_token_digest
  FROM users WHERE api_token_digest = sha256(convert_to('pgbench-token-' || :uid, 'UTF8')) LIMIT 1;
INSERT INTO idempotency_keys (idempotency_key, lock_token, request_method, request_path, request_params, recovery_point, user_id, locked_at)
  VALUES ('pgbench-replay-key-' || :uid || '-' || :n, gen_random_uuid(), 'POST', '/rides.v1.RideService/CreateRide',
          '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}', 'started', :uid, now())
  ON CONFLICT (user_id, idempotency_key) DO NOTHING
  RETURNING id, created_at;
SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path,
       request_params, response_code, response_body, recovery_point, user_id
  FROM idempotency_keys WHERE user_id = :uid AND idempotency_key = 'pgbench-replay-key-' || :uid || '-' || :n LIMIT 1;
