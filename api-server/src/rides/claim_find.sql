-- The part of CreateRide's claim that reads (`claim.rs`: `ClaimRides` and `ClaimReads` both
-- begin with it): per claim, the caller, authenticated by the digest of its API token or,
-- for a call on a user's behalf, by user id; and the key row if it exists, with whether it
-- binds the claim's request (`binds`: the stored parameters are compared here and never sent
-- back). Lookups are `LATERAL … LIMIT 1` so that the generic plan, which cannot know how
-- many claims a batch holds, stays one index probe per claim instead of hashing whole tables.
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
)
