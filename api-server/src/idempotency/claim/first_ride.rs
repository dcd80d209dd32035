//! A fresh key's first phase, written by the claim that inserts the key.
//!
//! CreateRide's first phase (`started` → `ride_created`: the ride and its audit record, whose
//! values `crate::rides` builds) needs nothing the claim does not already have, and a
//! fresh key has no earlier attempt to resume. So the claim that inserts a key can insert its
//! ride in the same statement, and the key is born at `ride_created`: one statement and one
//! commit fewer per new ride, and one batch fewer to wait for. The merged commit is the one
//! `started`'s phase makes on its own otherwise, so it waits for the WAL flush (`ride_created`
//! must be durable before the charge, the durability table in `contract::key`); a crash before
//! it leaves nothing. Phase `started` has no statement of its own: a key stays at `started` only
//! if a server from before run 24 of docs/history/performance.md left it there, and
//! `workers admin keys upgrade` retires such keys (docs/operations.md, "Upgrading").
//!
//! This is the one place the idempotency engine writes a request type's rows; the values come
//! from the request type as plain columns, so this module still knows nothing of what a ride
//! means.

use chrono::{DateTime, Utc};
use ipnet::IpNet;
use schema::models::Ride;

/// The columns of a fresh key's ride and its audit record.
#[derive(Clone, Debug)]
pub struct FirstRide {
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
    pub amount: i64,
    pub currency: String,
    /// The audit record's data.
    pub audit_data: serde_json::Value,
    pub origin_ip: IpNet,
    /// The server's `DEPLOYMENT_ID`, which the ride keeps (its charge's provider key and
    /// marker).
    pub deployment_id: String,
}

impl FirstRide {
    /// The ride the claim inserted with these values, as the statement returned its id and
    /// creation time.
    pub(super) fn inserted(
        &self,
        key_id: i64,
        user_id: i64,
        ride_id: i64,
        created_at: DateTime<Utc>,
    ) -> Ride {
        Ride {
            id: ride_id,
            created_at,
            idempotency_key_id: Some(key_id),
            origin_lat: self.origin_lat,
            origin_lon: self.origin_lon,
            target_lat: self.target_lat,
            target_lon: self.target_lon,
            amount: self.amount,
            currency: self.currency.clone(),
            stripe_charge_id: None,
            user_id,
            deployment_id: Some(self.deployment_id.clone()),
        }
    }
}

/// The claim statements' CTEs that insert a first ride and its audit record for every row of a
/// CTE named `first_ride` (key_id, user_id, origin_lat, origin_lon, target_lat, target_lon,
/// amount, currency, data, origin_ip, deployment_id), defined by each statement from the keys it
/// inserted. The
/// rides come back in a CTE named `ride` (id, created_at, idempotency_key_id).
macro_rules! first_ride_writes {
    () => {
        "ride AS (INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, user_id, deployment_id) \
         SELECT key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id, \
         deployment_id FROM first_ride ORDER BY key_id RETURNING id, created_at, idempotency_key_id, user_id), \
         audit AS (INSERT INTO audit_records (action, data, origin_ip, resource_id, \
         resource_type, user_id) \
         SELECT 'ride.created', first_ride.data, first_ride.origin_ip, ride.id, 'ride', \
         ride.user_id FROM ride JOIN first_ride ON first_ride.key_id = ride.idempotency_key_id)"
    };
}
pub(super) use first_ride_writes;
