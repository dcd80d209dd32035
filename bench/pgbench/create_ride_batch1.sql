-- One CreateRide with a fresh key, like create_ride.sql, but each of its four statements in the
-- BATCHED form the api-server sends when several requests share a statement, here with arrays of
-- exactly one element: what a request would cost if the server kept only the batched statement
-- of each phase and sent a lone request as a batch of one. Run beside create_ride.sql (same
-- values, same variables, same fixtures) to measure that cost. Four statements, no explicit
-- transaction, so each is its own implicit READ COMMITTED transaction:
--   1. authenticate and claim (the claim, api-server/src/rides/claim.sql):
--      input unnested from the arrays, the user by a LATERAL probe on the token digest, the key
--      row by a LATERAL probe if it exists, else INSERT ... ORDER BY ... ON CONFLICT DO NOTHING
--      of the key with the claim's lock token, which also identifies the claim (req);
--   2. phase started (CreateRideRecordBatch, retired with the older-server paths, issue 30):
--      the fence (contract/src/writes) (input, then each key locked FOR NO KEY UPDATE in key id order),
--      INSERT rides, INSERT audit_records, UPDATE keys to ride_created by = ANY(ARRAY(...)),
--      returning the rides;
--   (the provider call, which is not database work and is left out)
--   3. charge recorded (the charge's record, contract/src/writes/record_charge.sql, as it was until
--      run 24; since then it also stages the receipt and finishes the key): batch fence,
--      UPDATE rides' charge ids, UPDATE keys to charge_created;
--   4. phase charge_created (StageReceiptBatch, retired with the older-server paths): batch
--      fence, INSERT staged jobs, UPDATE keys finished (contract::finish_key!) from the fence.
-- Differences from the server: as in create_ride.sql, the token digest and lock token are
-- computed in the database (the digest once per claim, in the input), and the values are
-- literals of the same size and type; each array holds one element and is built in the statement
-- where the server binds one array parameter, and the output columns are renamed for \gset
-- (key_id, tok, ride_id, ...) where the server reads found.* and ride.*. The arrays that carry a
-- variable are built from text, ('{' || :key_id || '}')::int8[], not as ARRAY[:key_id]::int8[]:
-- the planner counts the elements of an ARRAY[...] (1 row), but not of a parameter (10 rows), and
-- only the text form gives the generic plans the server's statements get (checked with EXPLAIN
-- against the Rust SQL with typed array parameters: same plans, same estimates).
-- Variables: -D user_base=<id of the first pgbench user>; users user_base .. user_base+clients-1
-- must exist with api_token_digest = sha256('pgbench-token-' || id).
\set uid :user_base + :client_id
\set k random(1, 999999999999999)
WITH unflushed AS (SELECT set_config('synchronous_commit', 'off', true) AS setting),
  input AS (SELECT * FROM unnest(ARRAY[sha256(convert_to('pgbench-token-' || :uid, 'UTF8'))]::bytea[],
      ('{pgbench-ride-key-' || :client_id || '-' || :k || '}')::text[], ARRAY[gen_random_uuid()]::uuid[], ARRAY['POST']::text[],
      ARRAY['/rides.v1.RideService/CreateRide']::text[],
      ARRAY['{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb]::jsonb[])
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
SELECT caller.req, caller.id AS caller_id, caller.created_at AS caller_created_at, caller.email, caller.stripe_customer_id, caller.stripe_payment_method_id, caller.api_token_digest,
       found.found_req, found.id AS key_id, found.created_at, found.idempotency_key, found.last_run_at, found.locked_at, found.lock_token AS tok, found.request_method,
       found.request_path, found.request_params, found.response_code, found.response_body, found.recovery_point, found.user_id, found.inserted
  FROM caller JOIN found ON found.found_req = caller.req \gset
WITH input AS (SELECT * FROM unnest(('{' || :key_id || '}')::int8[], ('{' || :tok || '}')::uuid[], ('{' || :uid || '}')::int8[],
      ARRAY[37.7749]::float8[], ARRAY[-122.4194]::float8[], ARRAY[37.3382]::float8[], ARRAY[-121.8863]::float8[],
      ARRAY['{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb]::jsonb[],
      ARRAY['127.0.0.1/32'::cidr]::cidr[])
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
SELECT ride.id AS ride_id, ride.created_at AS ride_created_at, ride.idempotency_key_id, ride.origin_lat, ride.origin_lon, ride.target_lat, ride.target_lon, ride.amount, ride.currency, ride.stripe_charge_id, ride.user_id
  FROM ride JOIN moved ON moved.id = ride.idempotency_key_id \gset
WITH input AS (SELECT * FROM unnest(('{' || :key_id || '}')::int8[], ('{' || :tok || '}')::uuid[], ('{' || :uid || '}')::int8[],
      ('{pi_pgbench_' || :key_id || '_aaaaaaaaaa}')::text[], ('{' || :ride_id || '}')::int8[])
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
WITH input AS (SELECT * FROM unnest(('{' || :key_id || '}')::int8[], ('{' || :tok || '}')::uuid[], ('{' || :uid || '}')::int8[],
      ARRAY[('{"ride_id": ' || :ride_id || ', "user_id": ' || :uid || ', "amount": 2000, "currency": "usd", "charge_id": "pi_pgbench_' || :key_id || '_aaaaaaaaaa", "created_at": "2026-11-21T09:37:44.892483Z"}')::jsonb]::jsonb[],
      ARRAY['{}'::jsonb]::jsonb[], ARRAY[0]::int4[],
      ARRAY[('{"outcome": "ride_created", "message": "Payment accepted. Your pilot is on their way!", "ride": {"id": ' || :ride_id || ', "origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863, "charge_id": "pi_pgbench_' || :key_id || '_aaaaaaaaaa", "amount": 2000, "currency": "usd", "created_at": "2026-11-21T09:37:44.892483Z"}}')::jsonb]::jsonb[])
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
