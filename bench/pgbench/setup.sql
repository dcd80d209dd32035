-- Scratch-database fixtures for the pgbench scripts (run by bench/run.sh with psql -v):
-- :users pgbench users whose token digest is sha256('pgbench-token-' || id), and
-- :keys_per_user finished keys per user named 'pgbench-replay-key-<user id>-<n>' for the replay
-- scripts, each with a stored response of the size the api-server stores.
INSERT INTO users (email, stripe_customer_id, stripe_payment_method_id, api_token_digest)
  SELECT 'pgbench-' || i || '@bench.rocketrides.test', 'cus_pgbench_' || i, 'pm_card_visa', sha256(convert_to('pgbench-placeholder-' || i, 'UTF8'))
  FROM generate_series(1, :users) AS i;
UPDATE users SET api_token_digest = sha256(convert_to('pgbench-token-' || id, 'UTF8')) WHERE email LIKE 'pgbench-%';
INSERT INTO idempotency_keys (idempotency_key, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id)
  SELECT 'pgbench-replay-key-' || u.id || '-' || n, 'POST', '/rides.v1.RideService/CreateRide',
         '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}', 0,
         ('{"outcome": "ride_created", "message": "Payment accepted. Your pilot is on their way!", "ride": {"id": ' || n || ', "origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863, "charge_id": "pi_pgbench_replay_aaaaaaaaaaaa", "amount": 2000, "currency": "usd", "created_at": "2026-11-21T09:37:44.892483Z"}}')::jsonb,
         'finished', u.id
  FROM users u CROSS JOIN generate_series(1, :keys_per_user) AS n
  WHERE u.email LIKE 'pgbench-%';
ANALYZE;
SELECT min(id) AS user_base FROM users WHERE email LIKE 'pgbench-%';
