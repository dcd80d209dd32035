-- The merged batched ceiling: create_ride_batched.sql with its statements merged as the api-server
-- sends a fresh key's since run 24: two statements for :batch rides, each waiting for the WAL flush:
--   1. authenticate, claim :batch keys and create their rides (the claim, rides/claim.sql, inserts
--      each key at ride_created with its ride and audit record, rides/claim.sql);
--   (the provider calls, which are not database work, are left out)
--   2. charges recorded, receipts staged and keys finished (contract/src/writes/record_charge.sql,
--      rides/ride_created.rs).
-- In run 23 this script was three statements (the charges recorded on their own, unflushed, then
-- the receipts); its figures in docs/performance.md are for that version.
-- Not #18's batched ceiling (that is the four statements of create_ride_batched.sql, which the
-- table divides by); bench/run.sh reports it beside it as merged-ceiling, so that a reader can
-- see the service against the row work of its own statements too. Variables, arrays and
-- differences from the server as in create_ride_batched.sql.
\set k random(1, 999999999999999)
\set first :client_id * :batch
WITH input AS (SELECT * FROM unnest(
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
    SELECT caller.id, input.key, input.token, input.method, input.path, input.params, 'ride_created', now()
      FROM caller JOIN input ON input.token = caller.req
    WHERE NOT EXISTS (SELECT FROM existing WHERE existing.found_req = caller.req)
    ORDER BY caller.id, input.key
    ON CONFLICT (user_id, idempotency_key) DO NOTHING
    RETURNING id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id),
  first_ride AS (SELECT inserted.id AS key_id, inserted.user_id, 37.7749::float8 AS origin_lat, -122.4194::float8 AS origin_lon,
      37.3382::float8 AS target_lat, -121.8863::float8 AS target_lon, 2000::int8 AS amount, 'usd'::text AS currency,
      '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb AS data,
      '127.0.0.1/32'::cidr AS origin_ip FROM inserted),
  ride AS (INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id)
    SELECT key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id FROM first_ride ORDER BY key_id
    RETURNING id, created_at, idempotency_key_id, user_id),
  audit AS (INSERT INTO audit_records (action, data, origin_ip, resource_id, resource_type, user_id)
    SELECT 'ride.created', first_ride.data, first_ride.origin_ip, ride.id, 'ride', ride.user_id FROM ride JOIN first_ride ON first_ride.key_id = ride.idempotency_key_id),
  found AS (SELECT lock_token AS found_req, id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id, true AS inserted FROM inserted
    UNION ALL SELECT found_req, id, created_at, idempotency_key, last_run_at, locked_at, lock_token, request_method, request_path, request_params, response_code, response_body, recovery_point, user_id, false FROM existing)
SELECT array_agg(found.id ORDER BY found.id) AS key_ids, array_agg(found.lock_token ORDER BY found.id) AS toks,
       array_agg(found.user_id ORDER BY found.id) AS uids, array_agg(ride.id ORDER BY found.id) AS ride_ids
  FROM caller JOIN found ON found.found_req = caller.req LEFT JOIN ride ON ride.idempotency_key_id = found.id \gset
WITH input AS (SELECT * FROM unnest(:key_ids::int8[], :toks::uuid[], :uids::int8[],
      ARRAY(SELECT 'pi_pgbench_' || k || '_aaaaaaaaaa' FROM unnest(:key_ids::int8[]) k)::text[], :ride_ids::int8[],
      ARRAY(SELECT ('{"ride_id": ' || r || ', "user_id": ' || u || ', "amount": 2000, "currency": "usd", "charge_id": "pi_pgbench_' || k || '_aaaaaaaaaa", "created_at": "2026-11-21T09:37:44.892483Z"}')::jsonb
            FROM unnest(:ride_ids::int8[], :uids::int8[], :key_ids::int8[]) AS x(r, u, k))::jsonb[],
      array_fill('{}'::jsonb, ARRAY[:batch::int]), array_fill(0, ARRAY[:batch::int]),
      ARRAY(SELECT ('{"outcome": "ride_created", "message": "Payment accepted. Your pilot is on their way!", "ride": {"id": ' || r || ', "origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863, "charge_id": "pi_pgbench_' || k || '_aaaaaaaaaa", "amount": 2000, "currency": "usd", "created_at": "2026-11-21T09:37:44.892483Z"}}')::jsonb
            FROM unnest(:ride_ids::int8[], :key_ids::int8[]) AS x(r, k))::jsonb[])
    AS i(key_id, token, user_id, charge_id, ride_id, job_args, trace_context, response_code, response_body)),
  fence AS (SELECT input.* FROM (SELECT * FROM input ORDER BY key_id) input
    CROSS JOIN LATERAL (SELECT FROM idempotency_keys WHERE idempotency_keys.id = input.key_id AND idempotency_keys.lock_token = input.token
      AND idempotency_keys.user_id = input.user_id AND idempotency_keys.recovery_point = 'ride_created' FOR NO KEY UPDATE) locked),
  charged AS (UPDATE rides SET stripe_charge_id = fence.charge_id FROM fence
    WHERE rides.id = ANY(ARRAY(SELECT ride_id FROM fence)) AND rides.id = fence.ride_id AND rides.user_id = fence.user_id
      AND rides.idempotency_key_id = fence.key_id
    RETURNING rides.idempotency_key_id AS key_id),
  settled AS (SELECT fence.* FROM fence JOIN charged USING (key_id)),
  job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context)
    SELECT 'send_ride_receipt', job_args, trace_context FROM settled ORDER BY key_id)
UPDATE idempotency_keys SET recovery_point = 'finished', response_code = src.response_code, response_body = src.response_body,
    locked_at = NULL, lock_token = NULL
  FROM settled src WHERE idempotency_keys.id = ANY(ARRAY(SELECT key_id FROM settled)) AND idempotency_keys.id = src.key_id
    AND idempotency_keys.user_id = src.user_id
  RETURNING idempotency_keys.id;
