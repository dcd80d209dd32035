//! The claim's one statement, for a caller known by id or by the digest of its token, and the
//! key columns every claim statement reads (the batched form, `batched.rs`, uses them too).

use schema::prepared::Statement;

use super::first_ride::first_ride_writes;

/// Every column of `idempotency_keys` that [`KeyRow`] reads, by name, each with the same prefix
/// (a table alias and its dot) if one is given.
macro_rules! key_columns {
    () => {
        key_columns!("")
    };
    ($p:literal) => {
        concat!(
            $p,
            "id, ",
            $p,
            "created_at, ",
            $p,
            "idempotency_key, ",
            $p,
            "last_run_at, ",
            $p,
            "locked_at, ",
            $p,
            "lock_token, ",
            $p,
            "lock_holder, ",
            $p,
            "request_method, ",
            $p,
            "request_path, ",
            $p,
            "request_params, ",
            $p,
            "response_code, ",
            $p,
            "response_body, ",
            $p,
            "recovery_point, ",
            $p,
            "user_id"
        )
    };
}
pub(crate) use key_columns;

/// The claim's one statement, for the user `caller` selects (`$1`). The key row if it exists (a
/// replay, a mismatch or a resumption is decided from it without a lock); otherwise the key
/// inserted, locked by a fresh token. `ON CONFLICT DO NOTHING` waits for a concurrent inserter of
/// the same key and then yields to it; that key is newer than this statement's snapshot, so no
/// row comes back and the claim looks again. A key that exists inserts nothing, so a replay
/// writes nothing and burns no sequence value; no user, no row and nothing written. An inserted
/// key's first ride is inserted with it (`$7`–`$15`, [`FirstRide`]) and the key is born at
/// `ride_created`; that commit waits for the WAL flush, as `ride_created` must be durable before
/// the charge. `$16` is the holder id its lock names (`schema::liveness`), or NULL.
macro_rules! claim_sql {
    ($caller:literal, $may_insert:literal) => {
        concat!(
            "WITH caller AS (SELECT id, created_at, email, stripe_customer_id, \
             stripe_payment_method_id, api_token_digest FROM users WHERE ",
            $caller,
            "), existing AS (SELECT ",
            key_columns!(),
            " FROM idempotency_keys WHERE user_id = (SELECT id FROM caller) \
             AND idempotency_key = $2), \
             inserted AS (INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, \
             lock_holder, request_method, request_path, request_params, recovery_point, locked_at) \
             SELECT caller.id, $2, $3, $16::int8, $4, $5, $6, 'ride_created', now() FROM caller \
             WHERE ",
            $may_insert,
            " AND NOT EXISTS (SELECT FROM existing) \
             ON CONFLICT (user_id, idempotency_key) DO NOTHING RETURNING ",
            key_columns!(),
            "), first_ride AS (SELECT inserted.id AS key_id, inserted.user_id, \
             $7::float8 AS origin_lat, $8::float8 AS origin_lon, $9::float8 AS target_lat, \
             $10::float8 AS target_lon, $11::int8 AS amount, $12::text AS currency, \
             $13::jsonb AS data, $14::cidr AS origin_ip, $15::text AS deployment_id \
             FROM inserted), ",
            first_ride_writes!(),
            ", found AS (SELECT ",
            key_columns!(),
            ", true AS inserted FROM inserted UNION ALL SELECT ",
            key_columns!(),
            ", false FROM existing) \
             SELECT caller.id AS caller_id, caller.created_at AS caller_created_at, caller.email, \
             caller.stripe_customer_id, caller.stripe_payment_method_id, caller.api_token_digest, \
             found.*, ride.id AS ride_id, ride.created_at AS ride_created_at \
             FROM caller, found LEFT JOIN ride ON ride.idempotency_key_id = found.id"
        )
    };
}

/// The claim of a user known by id: a call on the user's behalf with the internal credential.
/// It never inserts a key (`false` in the insert's condition, so no race can slip one in between
/// a check and the claim): the completer only resumes keys the user created, and the credential
/// must not charge any user for a key of its own making.
pub(super) struct ClaimById;

impl Statement for ClaimById {
    const SQL: &'static str = claim_sql!("id = $1", "false");
}

/// The claim of the owner of an API token, by its digest: authentication in the same round trip.
pub(super) struct ClaimByToken;

impl Statement for ClaimByToken {
    const SQL: &'static str = claim_sql!("api_token_digest = $1", "true");
}
