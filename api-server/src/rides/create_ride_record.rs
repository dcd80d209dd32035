//! Phase `started`: the ride, its audit record and the recovery point `ride_created`, in one
//! fenced statement ([`CreateRideRecord`]) or, for several requests at once, in one batched
//! statement ([`CreateRideRecordBatch`]) that does exactly the same writes per request.
//!
//! Why batch at all: after the claims are batched, a new ride costs the database three
//! statements, each with its own commit, and more than half of what PostgreSQL spends on a ride is
//! the fixed price of those statements, not their rows. Each batched phase statement does, for
//! every request in it, exactly the writes of its one-request statement, fenced the same way
//! (`contract::batch_fence!`): a request whose lease was taken over writes nothing and gets no
//! row back (`StoreError::LockLost`), while the other requests in the batch commit. Lookups of
//! existing rows go through `= ANY(ARRAY(…))` or a `LATERAL` probe, so that the generic plan,
//! which cannot know how many requests a batch holds, stays index probes. Only the price differs:
//! one statement start, one set of relation locks and one commit (one WAL flush) for the batch.

use std::collections::HashMap;

use diesel::{
    OptionalExtension,
    result::Error as DieselError,
    sql_types::{self, Array, BigInt, Cidr, Double, Jsonb, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::FutureExt;
use ipnet::IpNet;
use schema::{
    models::Ride,
    prepared::{Statement, prepared},
    store::StoreError,
};
use scoped_futures::ScopedFutureExt;

use super::{RideParams, RideRequest, Rides};
use crate::{
    config::Price,
    idempotency::{self, BatchStatement, Fence, FenceArrays, FirstRide, Lease},
};

impl Rides {
    /// This phase's writes for a fresh key, made by the key's claim
    /// (`crate::idempotency::FirstRide`): the same columns as [`CreateRideRecord`]'s.
    pub(super) fn first_ride(&self, params: RideParams, origin_ip: std::net::IpAddr) -> FirstRide {
        FirstRide {
            origin_lat: params.origin_lat,
            origin_lon: params.origin_lon,
            target_lat: params.target_lat,
            target_lon: params.target_lon,
            amount: self.price.amount,
            currency: self.price.currency.clone(),
            audit_data: audit_data(params),
            origin_ip: IpNet::from(origin_ip),
            deployment_id: self.stripe.deployment_id().as_str().to_owned(),
        }
    }

    /// Phase `started`: the ride and its audit record.
    pub(super) async fn create_ride_record(
        &self,
        lease: &Lease,
        request: &RideRequest,
    ) -> Result<Ride, StoreError> {
        let params = request.params;
        let origin_ip = IpNet::from(request.origin_ip);
        let data = audit_data(params);
        let new_ride = || NewRide {
            fence: lease.fence(),
            params,
            data: data.clone(),
            origin_ip,
        };
        idempotency::batched_phase(&self.new_rides, lease, new_ride, || {
            self.create_ride_record_alone(lease, params, &data, origin_ip)
        })
        .await
    }

    async fn create_ride_record_alone(
        &self,
        lease: &Lease,
        params: RideParams,
        data: &serde_json::Value,
        origin_ip: IpNet,
    ) -> Result<Ride, StoreError> {
        let price = &self.price;
        idempotency::atomic_phase(&self.pool, self.retry, lease, |conn| {
            prepared::<CreateRideRecord, _>(|q| {
                q.bind::<BigInt, _>(lease.key_id)
                    .bind::<sql_types::Uuid, _>(lease.token)
                    .bind::<BigInt, _>(lease.user_id)
                    .bind::<Double, _>(params.origin_lat)
                    .bind::<Double, _>(params.origin_lon)
                    .bind::<Double, _>(params.target_lat)
                    .bind::<Double, _>(params.target_lon)
                    .bind::<BigInt, _>(price.amount)
                    .bind::<Text, _>(price.currency.as_str())
                    .bind::<Jsonb, _>(data)
                    .bind::<Cidr, _>(origin_ip)
                    .bind::<Text, _>(self.stripe.deployment_id().as_str())
            })
            .get_result::<Ride>(conn)
            .map(OptionalExtension::optional)
            .scope_boxed()
        })
        .await
    }
}

/// The `ride.created` audit record's data: the request's parameters.
fn audit_data(params: RideParams) -> serde_json::Value {
    serde_json::to_value(params).unwrap_or_default()
}

/// Phase `started` as one statement: the ride, its audit record and the recovery point
/// `ride_created`, each step selecting from the one before so that a failed fence writes nothing;
/// returns the ride.
struct CreateRideRecord;

impl Statement for CreateRideRecord {
    const SQL: &'static str = concat!(
        "WITH ",
        contract::fence!("started"),
        ", ride AS (INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, user_id, deployment_id) \
         SELECT fence.id, $4, $5, $6, $7, $8, $9, fence.user_id, $12 FROM fence \
         RETURNING id, created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, stripe_charge_id, user_id, deployment_id), \
         audit AS (INSERT INTO audit_records (action, data, origin_ip, resource_id, \
         resource_type, user_id) \
         SELECT 'ride.created', $10, $11, ride.id, 'ride', ride.user_id FROM ride) \
         UPDATE idempotency_keys SET recovery_point = 'ride_created' FROM ride \
         WHERE idempotency_keys.id = $1 AND idempotency_keys.lock_token = $2 \
         AND idempotency_keys.user_id = $3 RETURNING ride.*"
    );
}

/// Phase `started` for several keys: see [`CreateRideRecord`].
pub struct CreateRideRecords {
    pub price: Price,
    /// The server's `DEPLOYMENT_ID`, which every ride keeps.
    pub deployment_id: String,
}

/// One request's part of [`CreateRideRecords`].
pub struct NewRide {
    pub fence: Fence,
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

    async fn execute(
        &self,
        conn: &mut AsyncPgConnection,
        items: &[NewRide],
    ) -> Result<Vec<Option<Ride>>, DieselError> {
        let column = |f: fn(&NewRide) -> f64| items.iter().map(f).collect::<Vec<f64>>();
        let fences = FenceArrays::of(items.iter().map(|item| item.fence));
        let origin_lats = column(|item| item.params.origin_lat);
        let origin_lons = column(|item| item.params.origin_lon);
        let target_lats = column(|item| item.params.target_lat);
        let target_lons = column(|item| item.params.target_lon);
        let data: Vec<&serde_json::Value> = items.iter().map(|item| &item.data).collect();
        let origin_ips: Vec<IpNet> = items.iter().map(|item| item.origin_ip).collect();
        let rides = prepared::<CreateRideRecordBatch, _>(|q| {
            q.bind::<Array<BigInt>, _>(&fences.key_ids)
                .bind::<Array<sql_types::Uuid>, _>(&fences.tokens)
                .bind::<Array<BigInt>, _>(&fences.user_ids)
                .bind::<Array<Double>, _>(&origin_lats)
                .bind::<Array<Double>, _>(&origin_lons)
                .bind::<Array<Double>, _>(&target_lats)
                .bind::<Array<Double>, _>(&target_lons)
                .bind::<Array<Jsonb>, _>(&data)
                .bind::<Array<Cidr>, _>(&origin_ips)
                .bind::<BigInt, _>(self.price.amount)
                .bind::<Text, _>(self.price.currency.as_str())
                .bind::<Text, _>(self.deployment_id.as_str())
        })
        .load::<Ride>(conn)
        .await?;
        let mut rides: HashMap<i64, Ride> = rides
            .into_iter()
            .filter_map(|ride| Some((ride.idempotency_key_id?, ride)))
            .collect();
        Ok(items
            .iter()
            .map(|item| rides.remove(&item.fence.key_id))
            .collect())
    }
}

struct CreateRideRecordBatch;

impl Statement for CreateRideRecordBatch {
    const SQL: &'static str = concat!(
        contract::batch_fence!(
            "started",
            "$4::float8[], $5::float8[], $6::float8[], $7::float8[], $8::jsonb[], $9::cidr[]",
            "origin_lat, origin_lon, target_lat, target_lon, data, origin_ip"
        ),
        ", ride AS (INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, user_id, deployment_id) \
         SELECT key_id, origin_lat, origin_lon, target_lat, target_lon, $10, $11, user_id, $12 \
         FROM fence ORDER BY key_id \
         RETURNING id, created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, stripe_charge_id, user_id, deployment_id), \
         audit AS (INSERT INTO audit_records (action, data, origin_ip, resource_id, \
         resource_type, user_id) \
         SELECT 'ride.created', fence.data, fence.origin_ip, ride.id, 'ride', ride.user_id \
         FROM ride JOIN fence ON fence.key_id = ride.idempotency_key_id), \
         moved AS (UPDATE idempotency_keys SET recovery_point = 'ride_created' FROM ride \
         WHERE idempotency_keys.id = ANY(ARRAY(SELECT idempotency_key_id FROM ride)) \
         AND idempotency_keys.id = ride.idempotency_key_id \
         AND idempotency_keys.user_id = ride.user_id RETURNING idempotency_keys.id) \
         SELECT ride.* FROM ride JOIN moved ON moved.id = ride.idempotency_key_id"
    );
}
