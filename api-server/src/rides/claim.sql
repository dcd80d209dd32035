-- CreateRide's claim, for one claim or many (see `crate::idempotency::claim::statement` for what
-- every claim statement must do). Per claim: the caller, authenticated by the digest of its API
-- token or, for a call on a user's behalf, by user id (which never inserts a key); the key row
-- if it exists, with its lock's state by the claim's lock rule (`idempotency_lock_state`: a
-- retry that finds another attempt's live lock is refused from this read alone) and whether it
-- binds the claim's request (`binds`: the stored parameters are compared here and never sent
-- back); otherwise the key inserted at `ride_created`, locked by the claim's token and naming its
-- holder, with its ride and the ride's audit record, whose data is the request's parameters as
-- the key stores them (phase `started`, merged into the claim: a fresh key has no earlier
-- attempt to resume). That commit waits for the WAL flush, as `ride_created` must be durable
-- before the charge. Lookups are `LATERAL … LIMIT 1` so that the generic plan, which cannot know
-- how many claims a batch holds, stays one index probe per claim instead of hashing whole tables.
WITH input AS (
    SELECT * FROM unnest(
        $token_digests::bytea[], $caller_ids::int8[], $keys::text[], $lock_tokens::uuid[],
        $holders::int8[], $methods::text[], $paths::text[], $params::jsonb[],
        $origin_lats::float8[], $origin_lons::float8[], $target_lats::float8[],
        $target_lons::float8[], $amounts::int8[], $currencies::text[],
        $origin_ips::cidr[], $deployment_ids::text[],
        $lock_timeouts::float8[], $holder_takeovers::float8[]
    ) AS i (digest, caller_id, key, token, holder, method, path, params,
            origin_lat, origin_lon, target_lat, target_lon, amount, currency,
            origin_ip, deployment_id, lock_timeout, holder_takeover)
),
caller AS (
    SELECT input.token AS req, input.key AS req_key, input.digest IS NOT NULL AS may_insert,
           input.method AS req_method, input.path AS req_path, input.params AS req_params,
           input.lock_timeout, input.holder_takeover, u.*
    FROM input
    CROSS JOIN LATERAL (
        SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id,
               api_token_digest
        FROM users WHERE users.api_token_digest = input.digest
        UNION ALL
        SELECT id, created_at, email, stripe_customer_id, stripe_payment_method_id,
               api_token_digest
        FROM users WHERE users.id = input.caller_id
        LIMIT 1
    ) u
),
existing AS (
    SELECT caller.req AS found_req, k.*
    FROM caller
    CROSS JOIN LATERAL (
        SELECT id, created_at, locked_at, lock_token, lock_holder, recovery_point,
               response_code, response_body,
               request_method = caller.req_method AND request_path = caller.req_path
                   AND request_params = caller.req_params AS binds
        FROM idempotency_keys
        WHERE user_id = caller.id AND idempotency_key = caller.req_key
        LIMIT 1
    ) k
),
inserted AS (
    INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, lock_holder,
                                  request_method, request_path, request_params,
                                  recovery_point, locked_at)
    SELECT caller.id, input.key, input.token, input.holder, input.method, input.path,
           input.params, 'ride_created', now()
    FROM caller JOIN input ON input.token = caller.req
    WHERE caller.may_insert
      AND NOT EXISTS (SELECT FROM existing WHERE existing.found_req = caller.req)
    ORDER BY caller.id, input.key
    ON CONFLICT (user_id, idempotency_key) DO NOTHING
    RETURNING id, created_at, locked_at, lock_token, lock_holder, recovery_point,
              response_code, response_body, user_id
),
ride AS (
    INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon,
                       amount, currency, user_id, deployment_id)
    SELECT inserted.id, input.origin_lat, input.origin_lon, input.target_lat, input.target_lon,
           input.amount, input.currency, inserted.user_id, input.deployment_id
    FROM inserted JOIN input ON input.token = inserted.lock_token
    ORDER BY inserted.id
    RETURNING id, created_at, idempotency_key_id, user_id
),
audit AS (
    INSERT INTO audit_records (action, data, origin_ip, resource_id, resource_type, user_id)
    SELECT 'ride.created', input.params, input.origin_ip, ride.id, 'ride', ride.user_id
    FROM ride
    JOIN inserted ON inserted.id = ride.idempotency_key_id
    JOIN input ON input.token = inserted.lock_token
),
found AS (
    SELECT lock_token AS found_req, id, created_at, locked_at, lock_token, lock_holder,
           recovery_point, response_code, response_body, true AS binds, true AS inserted
    FROM inserted
    UNION ALL
    SELECT existing.*, false FROM existing
)
SELECT caller.req, caller.id AS caller_id, caller.created_at AS caller_created_at,
       caller.email, caller.stripe_customer_id, caller.stripe_payment_method_id,
       caller.api_token_digest, found.*, ride.id AS ride_id, ride.created_at AS ride_created_at,
       CASE WHEN found.inserted THEN 'live'
            ELSE idempotency_lock_state(found.locked_at, found.lock_holder, found.created_at,
                                        caller.lock_timeout, caller.holder_takeover)
       END AS lock_state
FROM caller
JOIN found ON found.found_req = caller.req
LEFT JOIN ride ON ride.idempotency_key_id = found.id
