-- A replay sent as a first send (no `idempotency-key-resent`) as the api-server serves it, for
-- comparison with replay_reads.sql: ONE statement that authenticates and claims (the claim,
-- api-server/src/rides/claim_find.sql + claim.sql); a replay that says it is resent is served by
-- the same reads without the INSERTs (claim_read.sql). It finds the finished key and so
-- inserts nothing: no row lock, no transaction id, no WAL, no sequence value. Like the service's
-- statement it returns only the key columns a decision reads, and compares the stored parameters
-- with the request's in PostgreSQL (`binds`) instead of sending them back.
\set uid :user_base + :client_id
\set n random(1, :keys_per_user)
WITH caller AS (SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id, api_token_digest
    FROM users WHERE api_token_digest = sha256(convert_to('pgbench-token-' || :uid, 'UTF8'))),
  existing AS (SELECT id, created_at, locked_at, lock_token, lock_holder, recovery_point, response_code, response_body,
           request_method = 'POST' AND request_path = '/rides.v1.RideService/CreateRide'
             AND request_params = '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb AS binds
    FROM idempotency_keys WHERE user_id = (SELECT id FROM caller) AND idempotency_key = 'pgbench-replay-key-' || :uid || '-' || :n),
  inserted AS (INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, request_method, request_path, request_params, recovery_point, locked_at)
    SELECT caller.id, 'pgbench-replay-key-' || :uid || '-' || :n, gen_random_uuid(), 'POST', '/rides.v1.RideService/CreateRide',
           '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}'::jsonb, 'started', now() FROM caller
    WHERE NOT EXISTS (SELECT FROM existing)
    ON CONFLICT (user_id, idempotency_key) DO NOTHING
    RETURNING id, created_at, locked_at, lock_token, lock_holder, recovery_point, response_code, response_body),
  found AS (SELECT id, created_at, locked_at, lock_token, lock_holder, recovery_point, response_code, response_body, true AS binds, true AS inserted FROM inserted
    UNION ALL SELECT id, created_at, locked_at, lock_token, lock_holder, recovery_point, response_code, response_body, binds, false FROM existing)
SELECT caller.id AS caller_id, caller.created_at AS caller_created_at, caller.email, caller.stripe_customer_id, caller.stripe_payment_method_id, caller.api_token_digest,
       found.id AS key_id, found.created_at, found.locked_at, found.lock_token AS tok, found.lock_holder, found.recovery_point,
       found.response_code, found.response_body, found.binds, found.inserted
  FROM caller, found;
