//! CreateRide's three write phases for several requests per statement
//! ([`crate::idempotency::Batcher`]).
//!
//! After the claims are batched, a new ride costs the database three statements, each with its
//! own commit: more than half of what PostgreSQL spends on a ride is the fixed price of those
//! statements, not their rows. Each statement here does, for every request in it, exactly the
//! writes of its one-request statement in the parent module ([`super::CreateRideRecord`],
//! [`super::RecordCharge`], [`super::StageReceipt`]), fenced the same way:
//!
//! - `fence` locks each request's key row (`FOR NO KEY UPDATE`) and yields the request only if the
//!   key still carries the request's lock token, checked on the newest row version as the
//!   one-request fence is. Every write selects from it, so a request whose lease was taken over
//!   writes nothing and gets no row back ([`crate::idempotency::StoreError::LockLost`]), while
//!   the other requests in the batch commit.
//! - Keys are locked in key id order, so two batches never wait for each other in a cycle.
//! - Lookups of existing rows go through `= ANY(ARRAY(…))` or a `LATERAL` probe, so that the
//!   generic plan, which cannot know how many requests a batch holds, stays index probes.
//!
//! Only the writes differ from one request's statement: one statement start, one set of
//! relation locks and one commit (one WAL flush) for the whole batch.

use std::collections::{HashMap, HashSet};

use diesel::{
    result::Error as DieselError,
    sql_types::{self, Array, BigInt, Cidr, Double, Integer, Jsonb, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use ipnet::IpNet;
use schema::{
    SEND_RIDE_RECEIPT_JOB,
    models::Ride,
    prepared::{Statement, prepared},
};
use uuid::Uuid;

use super::RideParams;
use crate::{
    config::Price,
    idempotency::{BatchStatement, KeyMoved},
};

/// The CTEs every batched phase starts with: `input` (the arrays, one row per request, with the
/// column names `columns` gives after the key id and the lock token) and `fence`.
macro_rules! batch_fence {
    ($unnest:literal, $columns:literal) => {
        concat!(
            "WITH input AS (SELECT * FROM unnest($1::int8[], $2::uuid[], ",
            $unnest,
            ") AS i(key_id, token, ",
            $columns,
            ")), fence AS (SELECT input.* FROM (SELECT * FROM input ORDER BY key_id) input \
             CROSS JOIN LATERAL (SELECT FROM idempotency_keys \
             WHERE idempotency_keys.id = input.key_id \
             AND idempotency_keys.lock_token = input.token FOR NO KEY UPDATE) locked)"
        )
    };
}

/// Phase `started` for several keys: see [`super::CreateRideRecord`].
pub struct CreateRideRecords {
    pub price: Price,
}

/// One request's part of [`CreateRideRecords`].
pub struct NewRide {
    pub key_id: i64,
    pub token: Uuid,
    pub user_id: i64,
    pub params: RideParams,
    /// The audit record's data.
    pub data: serde_json::Value,
    pub origin_ip: IpNet,
}

impl BatchStatement for CreateRideRecords {
    type Item = NewRide;
    /// The ride, or `None` if the key's fence failed.
    type Output = Option<Ride>;
    const NAME: &'static str = "create_ride_record";
    /// Redone after a batch that committed, the phase would insert a second ride for the key; the
    /// unique index refuses it, but the caller would see an internal error instead of a retryable
    /// one.
    const REDO_AFTER_CONNECTION_LOSS: bool = false;

    async fn run(
        &self,
        conn: &mut AsyncPgConnection,
        items: &[NewRide],
    ) -> Result<Vec<Option<Ride>>, DieselError> {
        let column = |f: fn(&NewRide) -> f64| items.iter().map(f).collect::<Vec<f64>>();
        let key_ids: Vec<i64> = items.iter().map(|item| item.key_id).collect();
        let tokens: Vec<Uuid> = items.iter().map(|item| item.token).collect();
        let origin_lats = column(|item| item.params.origin_lat);
        let origin_lons = column(|item| item.params.origin_lon);
        let target_lats = column(|item| item.params.target_lat);
        let target_lons = column(|item| item.params.target_lon);
        let user_ids: Vec<i64> = items.iter().map(|item| item.user_id).collect();
        let data: Vec<&serde_json::Value> = items.iter().map(|item| &item.data).collect();
        let origin_ips: Vec<IpNet> = items.iter().map(|item| item.origin_ip).collect();
        let rides = prepared::<CreateRideRecordBatch, _>(|q| {
            q.bind::<Array<BigInt>, _>(&key_ids)
                .bind::<Array<sql_types::Uuid>, _>(&tokens)
                .bind::<Array<Double>, _>(&origin_lats)
                .bind::<Array<Double>, _>(&origin_lons)
                .bind::<Array<Double>, _>(&target_lats)
                .bind::<Array<Double>, _>(&target_lons)
                .bind::<Array<BigInt>, _>(&user_ids)
                .bind::<Array<Jsonb>, _>(&data)
                .bind::<Array<Cidr>, _>(&origin_ips)
                .bind::<BigInt, _>(self.price.amount)
                .bind::<Text, _>(self.price.currency.as_str())
        })
        .load::<Ride>(conn)
        .await?;
        let mut rides: HashMap<i64, Ride> = rides
            .into_iter()
            .filter_map(|ride| Some((ride.idempotency_key_id?, ride)))
            .collect();
        Ok(items
            .iter()
            .map(|item| rides.remove(&item.key_id))
            .collect())
    }
}

struct CreateRideRecordBatch;

impl Statement for CreateRideRecordBatch {
    const SQL: &'static str = concat!(
        batch_fence!(
            "$3::float8[], $4::float8[], $5::float8[], $6::float8[], $7::int8[], $8::jsonb[], \
             $9::cidr[]",
            "origin_lat, origin_lon, target_lat, target_lon, user_id, data, origin_ip"
        ),
        ", ride AS (INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, user_id) \
         SELECT key_id, origin_lat, origin_lon, target_lat, target_lon, $10, $11, user_id \
         FROM fence ORDER BY key_id \
         RETURNING id, created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, stripe_charge_id, user_id), \
         audit AS (INSERT INTO audit_records (action, data, origin_ip, resource_id, \
         resource_type, user_id) \
         SELECT 'ride.created', fence.data, fence.origin_ip, ride.id, 'ride', ride.user_id \
         FROM ride JOIN fence ON fence.key_id = ride.idempotency_key_id), \
         moved AS (UPDATE idempotency_keys SET recovery_point = 'ride_created' \
         WHERE idempotency_keys.id = ANY(ARRAY(SELECT idempotency_key_id FROM ride)) \
         RETURNING idempotency_keys.id) \
         SELECT ride.* FROM ride JOIN moved ON moved.id = ride.idempotency_key_id"
    );
}

/// The charge's atomic phase for several keys: see [`super::RecordCharge`].
pub struct RecordCharges;

/// One request's part of [`RecordCharges`].
pub struct ChargeMade {
    pub key_id: i64,
    pub token: Uuid,
    pub ride_id: i64,
    /// The provider's PaymentIntent id.
    pub charge_id: String,
}

/// For each request, in order, `Some` if its key is among those the statement moved on.
fn moved_keys<T>(items: &[T], key_id: fn(&T) -> i64, moved: Vec<KeyMoved>) -> Vec<Option<()>> {
    let moved: HashSet<i64> = moved.into_iter().map(|key| key.id).collect();
    items
        .iter()
        .map(|item| moved.contains(&key_id(item)).then_some(()))
        .collect()
}

impl BatchStatement for RecordCharges {
    type Item = ChargeMade;
    /// `Some` if the key moved on; `None` if its fence failed.
    type Output = Option<()>;
    const NAME: &'static str = "record_charge";
    /// Recording the same PaymentIntent id again changes nothing.
    const REDO_AFTER_CONNECTION_LOSS: bool = true;

    async fn run(
        &self,
        conn: &mut AsyncPgConnection,
        items: &[ChargeMade],
    ) -> Result<Vec<Option<()>>, DieselError> {
        let key_ids: Vec<i64> = items.iter().map(|item| item.key_id).collect();
        let tokens: Vec<Uuid> = items.iter().map(|item| item.token).collect();
        let charge_ids: Vec<&str> = items.iter().map(|item| item.charge_id.as_str()).collect();
        let ride_ids: Vec<i64> = items.iter().map(|item| item.ride_id).collect();
        let moved = prepared::<RecordChargeBatch, _>(|q| {
            q.bind::<Array<BigInt>, _>(&key_ids)
                .bind::<Array<sql_types::Uuid>, _>(&tokens)
                .bind::<Array<Text>, _>(&charge_ids)
                .bind::<Array<BigInt>, _>(&ride_ids)
        })
        .load::<KeyMoved>(conn)
        .await?;
        Ok(moved_keys(items, |item| item.key_id, moved))
    }
}

struct RecordChargeBatch;

impl Statement for RecordChargeBatch {
    const SQL: &'static str = concat!(
        batch_fence!("$3::text[], $4::int8[]", "charge_id, ride_id"),
        ", charged AS (UPDATE rides SET stripe_charge_id = fence.charge_id FROM fence \
         WHERE rides.id = ANY(ARRAY(SELECT ride_id FROM fence)) \
         AND rides.id = fence.ride_id AND rides.idempotency_key_id = fence.key_id \
         RETURNING rides.idempotency_key_id) \
         UPDATE idempotency_keys SET recovery_point = 'charge_created' \
         WHERE idempotency_keys.id = ANY(ARRAY(SELECT idempotency_key_id FROM charged)) \
         RETURNING idempotency_keys.id"
    );
}

/// Phase `charge_created` for several keys: see [`super::StageReceipt`].
pub struct StageReceipts;

/// One request's part of [`StageReceipts`].
pub struct ReceiptDue {
    pub key_id: i64,
    pub token: Uuid,
    pub job_args: serde_json::Value,
    pub trace_context: serde_json::Value,
    pub response_code: i32,
    pub response_body: serde_json::Value,
}

impl BatchStatement for StageReceipts {
    type Item = ReceiptDue;
    /// `Some` if the key was finished; `None` if its fence failed.
    type Output = Option<()>;
    const NAME: &'static str = "stage_receipt";
    /// A batch that committed finished and unlocked its keys, so a redo fails every fence and
    /// stages nothing twice.
    const REDO_AFTER_CONNECTION_LOSS: bool = true;

    async fn run(
        &self,
        conn: &mut AsyncPgConnection,
        items: &[ReceiptDue],
    ) -> Result<Vec<Option<()>>, DieselError> {
        let key_ids: Vec<i64> = items.iter().map(|item| item.key_id).collect();
        let tokens: Vec<Uuid> = items.iter().map(|item| item.token).collect();
        let job_args: Vec<&serde_json::Value> = items.iter().map(|item| &item.job_args).collect();
        let trace_contexts: Vec<&serde_json::Value> =
            items.iter().map(|item| &item.trace_context).collect();
        let codes: Vec<i32> = items.iter().map(|item| item.response_code).collect();
        let bodies: Vec<&serde_json::Value> =
            items.iter().map(|item| &item.response_body).collect();
        let moved = prepared::<StageReceiptBatch, _>(|q| {
            q.bind::<Array<BigInt>, _>(&key_ids)
                .bind::<Array<sql_types::Uuid>, _>(&tokens)
                .bind::<Array<Jsonb>, _>(&job_args)
                .bind::<Array<Jsonb>, _>(&trace_contexts)
                .bind::<Array<Integer>, _>(&codes)
                .bind::<Array<Jsonb>, _>(&bodies)
                .bind::<Text, _>(SEND_RIDE_RECEIPT_JOB)
        })
        .load::<KeyMoved>(conn)
        .await?;
        Ok(moved_keys(items, |item| item.key_id, moved))
    }
}

struct StageReceiptBatch;

impl Statement for StageReceiptBatch {
    const SQL: &'static str = concat!(
        batch_fence!(
            "$3::jsonb[], $4::jsonb[], $5::int4[], $6::jsonb[]",
            "job_args, trace_context, response_code, response_body"
        ),
        // A data-modifying CTE runs to completion whether or not anything reads it, and the
        // statement commits both writes or neither.
        ", job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context) \
         SELECT $7, job_args, trace_context FROM fence ORDER BY key_id) ",
        crate::idempotency::finish_key!("fence.response_code", "fence.response_body"),
        " FROM fence WHERE idempotency_keys.id = ANY(ARRAY(SELECT key_id FROM fence)) \
         AND idempotency_keys.id = fence.key_id RETURNING idempotency_keys.id"
    );
}
