-- One CreateRide with a fresh key, statement for statement as the api-server commits it
-- (api-server/src/{auth.rs,idempotency/mod.rs,rides.rs}), all READ COMMITTED:
--   auth read; claim (INSERT ... ON CONFLICT DO NOTHING RETURNING, autocommit); phase started (fence,
--   INSERT ride RETURNING, INSERT audit record, UPDATE key); charge (SELECT ride by key, then the
--   provider call, which is not database work and is left out; fence, UPDATE ride, UPDATE key);
--   phase charge_created (fence, SELECT ride, INSERT staged job, UPDATE key finished).
-- Differences: the token digest and lock token are computed in the database (sha256(),
-- gen_random_uuid()) instead of in the server; values are otherwise of the same size and type.
-- Variables: -D user_base=<id of the first pgbench user>; users user_base .. user_base+clients-1
-- must exist with api_token_digest = sha256('pgbench-token-' || id).
\set uid :user_base + :client_id
\set k random(1, 999999999999999)
SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id, api_token_digest
  FROM users WHERE api_token_digest = sha256(convert_to('pgbench-token-' || :uid, 'UTF8')) LIMIT 1;
INSERT INTO idempotency_keys (idempotency_key, lock_token, request_method, request_path, request_params, recovery_point, user_id, locked_at)
  VALUES ('pgbench-ride-key-' || :client_id || '-' || :k, gen_random_uuid(), 'POST', '/rides.v1.RideService/CreateRide',
          '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}', 'started', :uid, now())
  ON CONFLICT (user_id, idempotency_key) DO NOTHING
  RETURNING id AS key_id, created_at AS key_created_at, lock_token AS tok \gset
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT id FROM idempotency_keys WHERE id = :key_id AND lock_token = :tok LIMIT 1 FOR NO KEY UPDATE;
INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id)
  VALUES (:key_id, 37.7749, -122.4194, 37.3382, -121.8863, 2000, 'usd', :uid)
  RETURNING id AS ride_id, created_at AS ride_created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id \gset
INSERT INTO audit_records (action, data, origin_ip, resource_id, resource_type, user_id)
  VALUES ('ride.created', '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}', '127.0.0.1/32', :ride_id, 'ride', :uid);
UPDATE idempotency_keys SET recovery_point = 'ride_created' WHERE id = :key_id AND lock_token = :tok;
COMMIT;
SELECT id, created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, stripe_charge_id, user_id
  FROM rides WHERE idempotency_key_id = :key_id LIMIT 1;
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT id FROM idempotency_keys WHERE id = :key_id AND lock_token = :tok LIMIT 1 FOR NO KEY UPDATE;
UPDATE rides SET stripe_charge_id = 'pi_pgbench_' || :key_id || '_aaaaaaaaaa' WHERE id = :ride_id;
UPDATE idempotency_keys SET recovery_point = 'charge_created' WHERE id = :key_id AND lock_token = :tok;
COMMIT;
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT id FROM idempotency_keys WHERE id = :key_id AND lock_token = :tok LIMIT 1 FOR NO KEY UPDATE;
SELECT id, created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, stripe_charge_id, user_id
  FROM rides WHERE idempotency_key_id = :key_id LIMIT 1;
INSERT INTO staged_jobs (job_name, job_args, trace_context)
  VALUES ('send_ride_receipt',
          ('{"ride_id": ' || :ride_id || ', "user_id": ' || :uid || ', "amount": 2000, "currency": "usd", "charge_id": "pi_pgbench_' || :key_id || '_aaaaaaaaaa", "created_at": "2026-11-21T09:37:44.892483Z"}')::jsonb,
          '{}');
UPDATE idempotency_keys
  SET recovery_point = 'finished', response_code = 0,
      response_body = ('{"outcome": "ride_created", "message": "Payment accepted. Your pilot is on their way!", "ride": {"id": ' || :ride_id || ', "origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863, "charge_id": "pi_pgbench_' || :key_id || '_aaaaaaaaaa", "amount": 2000, "currency": "usd", "created_at": "2026-11-21T09:37:44.892483Z"}}')::jsonb,
      locked_at = NULL, lock_token = NULL
  WHERE id = :key_id AND lock_token = :tok;
COMMIT;
