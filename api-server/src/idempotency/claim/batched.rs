//! Claims by API token, several per statement ([`crate::idempotency::Batcher`]).
//!
//! A user's claim is one statement, and for a replay that statement is nearly all the work the
//! database does for the request, so it is the first statement worth batching. A batch of new
//! keys is also one commit, so keys claimed together share one WAL flush.
//!
//! What each claim decides is what the one-claim statement decides, row for row: the same
//! snapshot rules, the same `ON CONFLICT DO NOTHING` arbitration by the unique index. Two claims
//! of the same key in one batch cannot both win: the key's row is inserted once, and only the
//! claim whose lock token it carries gets it back; the other claim finds no row and looks again,
//! as it would after losing to a concurrent statement. Keys are inserted in (user, key) order so
//! that two batches that share keys wait for each other in one order and cannot deadlock. Each
//! claim that inserts its key inserts its first ride ([`super::FirstRide`]) with it, as the
//! one-claim statement does.

use std::{collections::HashMap, sync::Arc};

use diesel::{
    QueryableByName,
    result::Error as DieselError,
    sql_types::{Array, BigInt, Bytea, Cidr, Double, Jsonb, Nullable, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{
    Pool,
    liveness::HolderId,
    models::User,
    prepared::{Statement, prepared},
    store::{ConflictRetry, StoreError},
};
use uuid::Uuid;

use super::{CallerAndKey, FirstRide, KeyFound, claim_alone, first_ride_writes, key_columns};
use crate::{
    auth::Caller,
    idempotency::{BatchStatement, Batcher, Batching, IdempotencyKey, LockedBy, RequestSignature},
};

/// The claim by token, batched: see the module documentation. Its [`Batcher`] is one per
/// process.
pub struct Claims;

/// One claim waiting for its batch.
pub struct ClaimRequest {
    token_digest: [u8; 32],
    key: String,
    /// The lock token the key gets if this claim inserts it; also how the claim finds its row.
    lock_token: Uuid,
    /// The holder id the key's lock names if this claim inserts it.
    holder: Option<HolderId>,
    request: RequestSignature,
    first_ride: FirstRide,
}

impl Batcher<Claims> {
    pub fn for_claims(
        pool: Pool,
        policy: ConflictRetry,
        batching: Batching,
    ) -> Arc<Batcher<Claims>> {
        Batcher::new(Claims, pool, policy, batching)
    }

    /// The claim statement's result for the owner of `token_digest`: the user and what was
    /// found, or `None` as the one-claim statement returns it.
    pub(super) async fn claim(
        self: &Arc<Self>,
        token_digest: &[u8; 32],
        key: &IdempotencyKey,
        request: &RequestSignature,
        first_ride: &FirstRide,
        lock: LockedBy,
    ) -> Result<Option<(User, KeyFound)>, StoreError> {
        let lock_token = lock.token;
        if self.enabled() {
            let claim = ClaimRequest {
                token_digest: *token_digest,
                key: key.as_str().to_owned(),
                lock_token,
                holder: lock.holder,
                request: request.clone(),
                first_ride: first_ride.clone(),
            };
            if let Some(row) = self.submit(claim).await? {
                return Ok(row.map(|row| row.into_found(lock_token, first_ride)));
            }
        }
        claim_alone(
            self.pool(),
            self.policy(),
            Caller::Token(*token_digest),
            key,
            request,
            first_ride,
            lock,
        )
        .await
    }
}

impl BatchStatement for Claims {
    type Item = ClaimRequest;
    /// The claim's row, or `None` for an unknown token or a key that a concurrent claim inserted
    /// first.
    type Output = Option<Box<CallerAndKey>>;
    const NAME: &'static str = "claim";
    /// A claim run again after a batch that did commit finds its key, locked by the lock token
    /// the batch gave it, which the claim presents again: it goes on as the key's owner, and
    /// never makes a second key.
    const REDO_AFTER_CONNECTION_LOSS: bool = true;

    async fn execute(
        &self,
        conn: &mut AsyncPgConnection,
        batch: &[ClaimRequest],
    ) -> Result<Vec<Self::Output>, DieselError> {
        let digests: Vec<&[u8]> = batch.iter().map(|c| c.token_digest.as_slice()).collect();
        let keys: Vec<&str> = batch.iter().map(|c| c.key.as_str()).collect();
        let lock_tokens: Vec<Uuid> = batch.iter().map(|c| c.lock_token).collect();
        let holders: Vec<Option<HolderId>> = batch.iter().map(|c| c.holder).collect();
        let methods: Vec<&str> = batch.iter().map(|c| c.request.method).collect();
        let paths: Vec<&str> = batch.iter().map(|c| c.request.path).collect();
        let params: Vec<&serde_json::Value> = batch.iter().map(|c| &c.request.params).collect();
        let rides = FirstRideArrays::of(batch);
        let rows = prepared::<ClaimBatchByToken, _>(|q| {
            q.bind::<Array<Bytea>, _>(&digests)
                .bind::<Array<Text>, _>(&keys)
                .bind::<Array<diesel::sql_types::Uuid>, _>(&lock_tokens)
                .bind::<Array<Text>, _>(&methods)
                .bind::<Array<Text>, _>(&paths)
                .bind::<Array<Jsonb>, _>(&params)
                .bind::<Array<Double>, _>(&rides.origin_lats)
                .bind::<Array<Double>, _>(&rides.origin_lons)
                .bind::<Array<Double>, _>(&rides.target_lats)
                .bind::<Array<Double>, _>(&rides.target_lons)
                .bind::<Array<BigInt>, _>(&rides.amounts)
                .bind::<Array<Text>, _>(&rides.currencies)
                .bind::<Array<Jsonb>, _>(&rides.audit_data)
                .bind::<Array<Cidr>, _>(&rides.origin_ips)
                .bind::<Array<Text>, _>(&rides.deployment_ids)
                .bind::<Array<Nullable<BigInt>>, _>(&holders)
        })
        .load::<BatchRow>(conn)
        .await?;
        let mut rows: HashMap<Uuid, Box<CallerAndKey>> = rows
            .into_iter()
            .map(|row| (row.req, Box::new(row.claim)))
            .collect();
        Ok(batch
            .iter()
            .map(|claim| rows.remove(&claim.lock_token))
            .collect())
    }
}

/// The `$7`–`$15` arrays of [`ClaimBatchByToken`]: each claim's first ride, column by column.
struct FirstRideArrays<'a> {
    origin_lats: Vec<f64>,
    origin_lons: Vec<f64>,
    target_lats: Vec<f64>,
    target_lons: Vec<f64>,
    amounts: Vec<i64>,
    currencies: Vec<&'a str>,
    audit_data: Vec<&'a serde_json::Value>,
    origin_ips: Vec<ipnet::IpNet>,
    deployment_ids: Vec<&'a str>,
}

impl<'a> FirstRideArrays<'a> {
    fn of(batch: &'a [ClaimRequest]) -> Self {
        let rides = || batch.iter().map(|claim| &claim.first_ride);
        let column = |f: fn(&FirstRide) -> f64| rides().map(f).collect();
        FirstRideArrays {
            origin_lats: column(|r| r.origin_lat),
            origin_lons: column(|r| r.origin_lon),
            target_lats: column(|r| r.target_lat),
            target_lons: column(|r| r.target_lon),
            amounts: rides().map(|r| r.amount).collect(),
            currencies: rides().map(|r| r.currency.as_str()).collect(),
            audit_data: rides().map(|r| &r.audit_data).collect(),
            origin_ips: rides().map(|r| r.origin_ip).collect(),
            deployment_ids: rides().map(|r| r.deployment_id.as_str()).collect(),
        }
    }
}

#[derive(QueryableByName)]
struct BatchRow {
    /// The lock token of the claim this row answers.
    #[diesel(sql_type = diesel::sql_types::Uuid)]
    req: Uuid,
    #[diesel(embed)]
    claim: CallerAndKey,
}

/// The claim statement (`ClaimByToken`) for arrays of claims, one element each: token
/// digest, key, lock token, method, path, parameters, and (`$16`) the holder id an inserted
/// key's lock names. A claim is identified by its lock token
/// (`req`), which is fresh per claim. Rows come back only for claims whose token matched a user,
/// and for a new key only to the claim whose lock token the inserted row carries. The lookups
/// are `LATERAL … LIMIT 1` so that the plan, which is generic once prepared and cannot know how
/// many claims a batch holds, stays one index probe per claim instead of hashing whole tables.
/// The first rides (`$7`–`$15`, [`FirstRideArrays`]) are inserted for the claims that inserted
/// their key, which are born at `ride_created`; the commit waits for the WAL flush, as the
/// one-claim statement's.
struct ClaimBatchByToken;

impl Statement for ClaimBatchByToken {
    const SQL: &'static str = concat!(
        "WITH input AS (SELECT * FROM unnest($1::bytea[], $2::text[], $3::uuid[], $4::text[], \
         $5::text[], $6::jsonb[], $7::float8[], $8::float8[], $9::float8[], \
         $10::float8[], $11::int8[], $12::text[], $13::jsonb[], $14::cidr[], $15::text[], \
         $16::int8[]) \
         AS i(digest, key, token, method, path, params, origin_lat, origin_lon, \
         target_lat, target_lon, amount, currency, data, origin_ip, deployment_id, holder)), \
         caller AS (SELECT input.token AS req, input.key AS req_key, u.* FROM input \
         CROSS JOIN LATERAL (SELECT id, created_at, email, stripe_customer_id, \
         stripe_payment_method_id, api_token_digest FROM users \
         WHERE users.api_token_digest = input.digest LIMIT 1) u), \
         existing AS (SELECT caller.req AS found_req, k.* FROM caller \
         CROSS JOIN LATERAL (SELECT ",
        key_columns!(),
        " FROM idempotency_keys WHERE user_id = caller.id \
         AND idempotency_key = caller.req_key LIMIT 1) k), \
         inserted AS (INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, \
         lock_holder, request_method, request_path, request_params, recovery_point, locked_at) \
         SELECT caller.id, input.key, input.token, input.holder, input.method, input.path, \
         input.params, 'ride_created', now() FROM caller JOIN input ON input.token = caller.req \
         WHERE NOT EXISTS (SELECT FROM existing WHERE existing.found_req = caller.req) \
         ORDER BY caller.id, input.key \
         ON CONFLICT (user_id, idempotency_key) DO NOTHING RETURNING ",
        key_columns!(""),
        "), first_ride AS (SELECT inserted.id AS key_id, inserted.user_id, input.origin_lat, \
         input.origin_lon, input.target_lat, input.target_lon, input.amount, input.currency, \
         input.data, input.origin_ip, input.deployment_id FROM inserted JOIN input ON input.token = inserted.lock_token), ",
        first_ride_writes!(),
        ", found AS (SELECT lock_token AS found_req, ",
        key_columns!(""),
        ", true AS inserted FROM inserted UNION ALL SELECT found_req, ",
        key_columns!(""),
        ", false FROM existing) \
         SELECT caller.req, caller.id AS caller_id, caller.created_at AS caller_created_at, \
         caller.email, caller.stripe_customer_id, caller.stripe_payment_method_id, \
         caller.api_token_digest, found.*, ride.id AS ride_id, ride.created_at AS ride_created_at \
         FROM caller JOIN found ON found.found_req = caller.req \
         LEFT JOIN ride ON ride.idempotency_key_id = found.id"
    );
}
