-- One CreateRide with a fresh key, statement for statement as the api-server sent it until run
-- 23 (docs/performance.md): four statements, no explicit transaction, so each is its own implicit
-- READ COMMITTED transaction. Since run 23 the server's claim of a fresh key also does statement 2
-- (api-server/src/rides/claim.sql) and waits for the flush; this script stays the reference the
-- per-ride ceiling has been measured with since run 3:
--   1. authenticate and claim: the user by token digest, and the key row if it exists, else
--      INSERT ... ON CONFLICT DO NOTHING of the key for that user (the claim, api-server/src/rides/claim.sql);
--   2. phase started: fence (SELECT ... FOR NO KEY UPDATE), INSERT ride, INSERT audit record,
--      UPDATE key to ride_created, returning the ride (CreateRideRecord);
--   (the provider call, which is not database work and is left out)
--   3. charge recorded: fence, UPDATE ride's charge id, UPDATE key to charge_created (the charge's record
--      until run 24; since then the record does statement 4 as well, in one flushed commit);
--   4. phase charge_created: fence, INSERT staged job, UPDATE key finished with the stored
--      response and unlocked (StageReceipt).
-- The ride is not read back: the server keeps the one statement 2 returned (an attempt that
-- resumes a key reads it; a fresh key never does).
-- Differences: the token digest and lock token are computed in the database (sha256(),
-- gen_random_uuid()) instead of in the server; values are otherwise of the same size and type.
-- Variables: -D user_base=<id of the first pgbench user>; users user_base .. user_base+clients-1
-- must exist with api_token_digest = sha256('pgbench-token-' || id).
\set uid :user_base + :client_id
\set k random(1, 999999999999999)
WITH unflushed AS (SELECT set_config('synchronous_commit', 'off', true) AS setting),
  caller AS (SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id, api_token_digest
    FROM users WHERE api_token_digest = sha256(convert_to('pgbench-token-' || :uid, 'UTF8'))),
  existing AS (SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id
    FROM idempotency_keys WHERE user_id = (SELECT id FROM caller) AND idempotency_key = 'pgbench-ride-key-' || :client_id || '-' || :k),
  inserted AS (INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, request_method, request_path, request_params, recovery_point, locked_at)
    SELECT caller.id, 'pgbench-ride-key-' || :client_id || '-' || :k, gen_random_uuid(), 'POST', '/rides.v1.RideService/CreateRide',
           '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb, 'started', now() FROM caller CROSS JOIN unflushed
    WHERE NOT EXISTS (SELECT FROM existing)
    ON CONFLICT (user_id, idempotency_key) DO NOTHING
    RETURNING id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id),
  found AS (SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id, true AS inserted FROM inserted
    UNION ALL SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id, false FROM existing)
SELECT caller.id AS caller_id, caller.created_at AS caller_created_at, caller.email, caller.stripe_customer_id, caller.stripe_payment_method_id, caller.api_token_digest,
       found.id AS key_id, found.created_at, found.idempotency_key, found.last_run_at, found.locked_at, found.lock_token AS tok, found.request_method, found.request_path,
       found.request_params, found.response_code, found.response_body, found.recovery_point, found.user_id, found.inserted
  FROM caller, found \gset
WITH fence AS (SELECT id, user_id FROM idempotency_keys WHERE id = :key_id AND lock_token = :tok AND user_id = :uid AND recovery_point = 'started' FOR NO KEY UPDATE),
  ride AS (INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id)
    SELECT fence.id, 37.7749, -122.4194, 37.3382, -121.8863, 2000, 'usd', fence.user_id FROM fence
    RETURNING id, created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, stripe_charge_id, user_id),
  audit AS (INSERT INTO audit_records (action, data, origin_ip, resource_id, resource_type, user_id)
    SELECT 'ride.created', '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb, '127.0.0.1/32'::cidr, ride.id, 'ride', ride.user_id FROM ride)
UPDATE idempotency_keys SET recovery_point = 'ride_created' FROM ride
  WHERE idempotency_keys.id = :key_id AND idempotency_keys.lock_token = :tok AND idempotency_keys.user_id = :uid
  RETURNING ride.id AS ride_id, ride.created_at AS ride_created_at, ride.idempotency_key_id, ride.origin_lat, ride.origin_lon, ride.target_lat, ride.target_lon, ride.amount, ride.currency, ride.stripe_charge_id, ride.user_id \gset
WITH fence AS (SELECT id, user_id FROM idempotency_keys WHERE id = :key_id AND lock_token = :tok AND user_id = :uid AND recovery_point = 'ride_created' FOR NO KEY UPDATE),
  unflushed AS (SELECT set_config('synchronous_commit', 'off', true) AS setting),
  charged AS (UPDATE rides SET stripe_charge_id = 'pi_pgbench_' || :key_id || '_aaaaaaaaaa' FROM fence CROSS JOIN unflushed
    WHERE rides.id = :ride_id AND rides.user_id = fence.user_id AND rides.idempotency_key_id = fence.id RETURNING rides.id)
UPDATE idempotency_keys SET recovery_point = 'charge_created' FROM charged
  WHERE idempotency_keys.id = :key_id AND idempotency_keys.lock_token = :tok AND idempotency_keys.user_id = :uid
  RETURNING idempotency_keys.id;
WITH fence AS (SELECT id, user_id FROM idempotency_keys WHERE id = :key_id AND lock_token = :tok AND user_id = :uid AND recovery_point = 'charge_created' FOR NO KEY UPDATE),
  job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context)
    SELECT 'send_ride_receipt',
           ('{"ride_id": ' || :ride_id || ', "user_id": ' || :uid || ', "amount": 2000, "currency": "usd", "charge_id": "pi_pgbench_' || :key_id || '_aaaaaaaaaa", "created_at": "2026-11-21T09:37:44.892483Z"}')::jsonb,
           '{}'::jsonb FROM fence RETURNING id)
UPDATE idempotency_keys SET recovery_point = 'finished', response_code = 0,
    response_body = ('{"outcome": "ride_created", "message": "Payment accepted. Your pilot is on their way!", "ride": {"id": ' || :ride_id || ', "origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863, "charge_id": "pi_pgbench_' || :key_id || '_aaaaaaaaaa", "amount": 2000, "currency": "usd", "created_at": "2026-11-21T09:37:44.892483Z"}}')::jsonb,
    locked_at = NULL, lock_token = NULL
  FROM job WHERE idempotency_keys.id = :key_id AND idempotency_keys.lock_token = :tok AND idempotency_keys.user_id = :uid
  RETURNING idempotency_keys.id;
