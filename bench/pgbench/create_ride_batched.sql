-- The batched ceiling: :batch fresh-key CreateRides per script run, the row work of each phase
-- written for all of them in ONE statement, as the api-server's batching sent it until run 23
-- when :batch requests shared every phase (docs/performance.md, "The batched ceiling"; since run
-- 23 a fresh key's claim also does statement 2, as create_ride_batched_merged.sql). Four statements, no
-- explicit transaction, so each is its own implicit READ COMMITTED transaction and its own commit:
--   1. authenticate and claim :batch keys (the claim, api-server/src/rides/claim.sql);
--   2. phase started for all of them (CreateRideRecordBatch, a statement of its own until the older-server
--      paths were retired, issue 30):
--      the fence (contract/src/writes), INSERT rides, INSERT audit_records, keys to ride_created;
--   (the provider calls, which are not database work, are left out)
--   3. charges recorded (the charge's record, contract/src/writes/record_charge.sql, until run 24; since then it does
--      statement 4 as well, as create_ride_batched_merged.sql);
--   4. receipts staged and keys finished (StageReceiptBatch, retired with the older-server paths).
-- Rides per second = pgbench's tps x :batch (bench-report multiplies).
-- Differences from the server: the arrays are built in the statement (ARRAY(SELECT ... FROM
-- generate_series(1, :batch::int))) where the server binds array parameters; like a bound array, the
-- planner cannot count them (it assumes 10 elements either way), so the plans are the server's
-- generic ones. The token digests and lock tokens are computed in the database. Statement 1
-- returns one row of arrays (key ids, tokens, user ids, for \gset) where the server reads one
-- row of key columns per claim, and statement 2 the ride ids where the server reads the rides.
-- The :batch requests belong to :batch consecutive users (wrapping at :users), as the server's
-- batches mix clients. Variables: -D user_base=<id of the first pgbench user> -D users=<count>
-- -D batch=<requests per statement>; users user_base .. user_base+users-1 must exist with
-- api_token_digest = sha256('pgbench-token-' || id) (bench/pgbench/setup.sql).
\set k random(1, 999999999999999)
\set first :client_id * :batch
WITH unflushed AS (SELECT set_config('synchronous_commit', 'off', true) AS setting),
  input AS (SELECT * FROM unnest(
      ARRAY(SELECT sha256(convert_to('pgbench-token-' || (:user_base::int8 + (:first::int8 + g) % :users::int8), 'UTF8'))
            FROM generate_series(1, :batch::int) g)::bytea[],
      ARRAY(SELECT 'pgbench-ride-key-' || :client_id || '-' || :k || '-' || g FROM generate_series(1, :batch::int) g)::text[],
      ARRAY(SELECT gen_random_uuid() FROM generate_series(1, :batch::int) g)::uuid[],
      ARRAY(SELECT 'POST' FROM generate_series(1, :batch::int) g)::text[],
      ARRAY(SELECT '/rides.v1.RideService/CreateRide' FROM generate_series(1, :batch::int) g)::text[],
      ARRAY(SELECT '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb
            FROM generate_series(1, :batch::int) g)::jsonb[])
    AS i(digest, key, token, method, path, params)),
  caller AS (SELECT input.token AS req, input.key AS req_key, u.* FROM input
    CROSS JOIN LATERAL (SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id, api_token_digest FROM users
      WHERE users.api_token_digest = input.digest LIMIT 1) u),
  existing AS (SELECT caller.req AS found_req, k.* FROM caller
    CROSS JOIN LATERAL (SELECT id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id
      FROM idempotency_keys WHERE user_id = caller.id AND idempotency_key = caller.req_key LIMIT 1) k),
  inserted AS (INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, request_method, request_path, request_params, recovery_point, locked_at)
    SELECT caller.id, input.key, input.token, input.method, input.path, input.params, 'started', now()
      FROM caller JOIN input ON input.token = caller.req CROSS JOIN unflushed
    WHERE NOT EXISTS (SELECT FROM existing WHERE existing.found_req = caller.req)
    ORDER BY caller.id, input.key
    ON CONFLICT (user_id, idempotency_key) DO NOTHING
    RETURNING id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id),
  found AS (SELECT lock_token AS found_req, id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id, true AS inserted FROM inserted
    UNION ALL SELECT found_req, id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id, false FROM existing)
SELECT array_agg(found.id ORDER BY found.id) AS key_ids, array_agg(found.lock_token ORDER BY found.id) AS toks,
       array_agg(found.user_id ORDER BY found.id) AS uids
  FROM caller JOIN found ON found.found_req = caller.req \gset
WITH input AS (SELECT * FROM unnest(:key_ids::int8[], :toks::uuid[], :uids::int8[],
      array_fill(37.7749::float8, ARRAY[:batch::int]), array_fill(-122.4194::float8, ARRAY[:batch::int]),
      array_fill(37.3382::float8, ARRAY[:batch::int]), array_fill(-121.8863::float8, ARRAY[:batch::int]),
      array_fill('{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb, ARRAY[:batch::int]),
      array_fill('127.0.0.1/32'::cidr, ARRAY[:batch::int]))
    AS i(key_id, token, user_id, origin_lat, origin_lon, target_lat, target_lon, data, origin_ip)),
  fence AS (SELECT input.* FROM (SELECT * FROM input ORDER BY key_id) input
    CROSS JOIN LATERAL (SELECT FROM idempotency_keys WHERE idempotency_keys.id = input.key_id AND idempotency_keys.lock_token = input.token
      AND idempotency_keys.user_id = input.user_id AND idempotency_keys.recovery_point = 'started' FOR NO KEY UPDATE) locked),
  ride AS (INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id)
    SELECT key_id, origin_lat, origin_lon, target_lat, target_lon, 2000, 'usd', user_id FROM fence ORDER BY key_id
    RETURNING id, created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, stripe_charge_id, user_id),
  audit AS (INSERT INTO audit_records (action, data, origin_ip, resource_id, resource_type, user_id)
    SELECT 'ride.created', fence.data, fence.origin_ip, ride.id, 'ride', ride.user_id FROM ride JOIN fence ON fence.key_id = ride.idempotency_key_id),
  moved AS (UPDATE idempotency_keys SET recovery_point = 'ride_created' FROM ride
    WHERE idempotency_keys.id = ANY(ARRAY(SELECT idempotency_key_id FROM ride)) AND idempotency_keys.id = ride.idempotency_key_id
      AND idempotency_keys.user_id = ride.user_id RETURNING idempotency_keys.id)
SELECT array_agg(ride.id ORDER BY ride.idempotency_key_id) AS ride_ids
  FROM ride JOIN moved ON moved.id = ride.idempotency_key_id \gset
WITH input AS (SELECT * FROM unnest(:key_ids::int8[], :toks::uuid[], :uids::int8[],
      ARRAY(SELECT 'pi_pgbench_' || k || '_aaaaaaaaaa' FROM unnest(:key_ids::int8[]) k)::text[], :ride_ids::int8[])
    AS i(key_id, token, user_id, charge_id, ride_id)),
  fence AS (SELECT input.* FROM (SELECT * FROM input ORDER BY key_id) input
    CROSS JOIN LATERAL (SELECT FROM idempotency_keys WHERE idempotency_keys.id = input.key_id AND idempotency_keys.lock_token = input.token
      AND idempotency_keys.user_id = input.user_id AND idempotency_keys.recovery_point = 'ride_created' FOR NO KEY UPDATE) locked),
  unflushed AS (SELECT set_config('synchronous_commit', 'off', true) AS setting),
  charged AS (UPDATE rides SET stripe_charge_id = fence.charge_id FROM fence CROSS JOIN unflushed
    WHERE rides.id = ANY(ARRAY(SELECT ride_id FROM fence)) AND rides.id = fence.ride_id AND rides.user_id = fence.user_id
      AND rides.idempotency_key_id = fence.key_id
    RETURNING rides.idempotency_key_id, rides.user_id)
UPDATE idempotency_keys SET recovery_point = 'charge_created' FROM charged
  WHERE idempotency_keys.id = ANY(ARRAY(SELECT idempotency_key_id FROM charged)) AND idempotency_keys.id = charged.idempotency_key_id
    AND idempotency_keys.user_id = charged.user_id
  RETURNING idempotency_keys.id;
WITH input AS (SELECT * FROM unnest(:key_ids::int8[], :toks::uuid[], :uids::int8[],
      ARRAY(SELECT ('{"ride_id": ' || r || ', "user_id": ' || u || ', "amount": 2000, "currency": "usd", "charge_id": "pi_pgbench_' || k || '_aaaaaaaaaa", "created_at": "2026-11-21T09:37:44.892483Z"}')::jsonb
            FROM unnest(:ride_ids::int8[], :uids::int8[], :key_ids::int8[]) AS x(r, u, k))::jsonb[],
      array_fill('{}'::jsonb, ARRAY[:batch::int]), array_fill(0, ARRAY[:batch::int]),
      ARRAY(SELECT ('{"outcome": "ride_created", "message": "Payment accepted. Your pilot is on their way!", "ride": {"id": ' || r || ', "origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863, "charge_id": "pi_pgbench_' || k || '_aaaaaaaaaa", "amount": 2000, "currency": "usd", "created_at": "2026-11-21T09:37:44.892483Z"}}')::jsonb
            FROM unnest(:ride_ids::int8[], :key_ids::int8[]) AS x(r, k))::jsonb[])
    AS i(key_id, token, user_id, job_args, trace_context, response_code, response_body)),
  fence AS (SELECT input.* FROM (SELECT * FROM input ORDER BY key_id) input
    CROSS JOIN LATERAL (SELECT FROM idempotency_keys WHERE idempotency_keys.id = input.key_id AND idempotency_keys.lock_token = input.token
      AND idempotency_keys.user_id = input.user_id AND idempotency_keys.recovery_point = 'charge_created' FOR NO KEY UPDATE) locked),
  job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context)
    SELECT 'send_ride_receipt', job_args, trace_context FROM fence ORDER BY key_id)
UPDATE idempotency_keys SET recovery_point = 'finished', response_code = fence.response_code, response_body = fence.response_body,
    locked_at = NULL, lock_token = NULL
  FROM fence WHERE idempotency_keys.id = ANY(ARRAY(SELECT key_id FROM fence)) AND idempotency_keys.id = fence.key_id
    AND idempotency_keys.user_id = fence.user_id
  RETURNING idempotency_keys.id;
