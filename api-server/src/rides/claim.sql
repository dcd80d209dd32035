-- CreateRide's claim, for one claim or many (see `crate::idempotency::claim::statement` for what
-- every claim statement must do); it continues `claim_find.sql`, which finds each claim's caller
-- and key. Per claim, a key not found is inserted at `ride_created` (only for a caller by token
-- digest: a call on a user's behalf never inserts a key), locked by the claim's token and naming
-- its holder, with its ride and the ride's audit record, whose data is the request's parameters
-- as the key stores them (phase `started`, merged into the claim: a fresh key has no earlier
-- attempt to resume). That commit waits for the WAL flush, as `ride_created` must be durable
-- before the charge. A key found comes back with its lock's state by the claim's lock rule
-- (`idempotency_lock_state`: a retry that finds another attempt's live lock is refused from
-- this read alone).
,
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
