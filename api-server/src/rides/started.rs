//! Phase `started`: the ride and its audit record, which take the key to `ride_created`. They are
//! written by the claim that inserts the key (`crate::idempotency::FirstRide`), in its statement,
//! so this phase has no statement of its own: here are the values it writes. A key stays at
//! `started` only if a server from before run 24 of docs/history/performance.md left it there;
//! this server does not resume such a key ([`super::CreateRideError::LeftByOlderServer`]), and
//! `workers admin keys upgrade` retires it (docs/operations.md, "Upgrading").

use ipnet::IpNet;

use super::{RideParams, Rides};
use crate::idempotency::FirstRide;

impl Rides {
    /// Phase `started`'s writes for a fresh key, made by the key's claim.
    pub(crate) fn first_ride(&self, params: RideParams, origin_ip: std::net::IpAddr) -> FirstRide {
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
}

/// The `ride.created` audit record's data: the request's parameters, as its key stores them.
fn audit_data(params: RideParams) -> serde_json::Value {
    params.stored().to_stored()
}
