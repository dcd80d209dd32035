-- CreateRide's claim for keys that most likely exist (a key its caller sent before, a call on a
-- user's behalf): `claim_find.sql` alone, without the writes of `claim.sql`, so a replay, a
-- mismatch or a key in use is decided without a write statement. Per claim, the key found with
-- its lock's state by the claim's lock rule; no row for a key (or caller) not found, which the
-- engine then sends to `claim.sql` if the claim may insert a key.
SELECT caller.req, caller.id AS caller_id, caller.created_at AS caller_created_at,
       caller.email, caller.stripe_customer_id, caller.stripe_payment_method_id,
       caller.api_token_digest, existing.*, false AS inserted, NULL::int8 AS ride_id,
       NULL::timestamptz AS ride_created_at,
       idempotency_lock_state(existing.locked_at, existing.lock_holder, existing.created_at,
                              caller.lock_timeout, caller.holder_takeover) AS lock_state
FROM caller
JOIN existing ON existing.found_req = caller.req
