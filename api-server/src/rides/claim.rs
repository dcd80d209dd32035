//! CreateRide's claim: the engine's claim statement ([`ClaimStatement`]) for rides. Both of its
//! statements begin with `claim_find.sql`, which finds each claim's caller and key. `claim.sql`
//! goes on to insert a key not found with phase `started`'s writes (the ride and its audit
//! record), so that the key is born at `ride_created`: one statement and one commit fewer per new
//! ride. `claim_read.sql` writes nothing: the engine sends it the claims whose key most likely
//! exists ([`ClaimRequest::sends`]). Phase `started` has no statement of its own; a key
//! stays at `started` only if an older server left it there, and `workers admin keys upgrade`
//! retires such keys (docs/operations.md, "Upgrading").

use std::{collections::HashMap, net::IpAddr};

use chrono::{DateTime, Utc};
use diesel::{
    QueryableByName,
    result::Error as DieselError,
    sql_types::{
        Array, BigInt, Bytea, Cidr, Double, Jsonb, Nullable, Text, Timestamptz, Uuid as SqlUuid,
    },
};
use diesel_async::AsyncPgConnection;
use ipnet::IpNet;
use schema::{JsonText, models::Ride};
use uuid::Uuid;

use super::{RideParams, Rides};
use crate::{
    auth::Caller,
    idempotency::{CallerAndKey, ClaimRequest, ClaimRow, ClaimStatement},
};

/// The columns of a fresh key's ride and its audit record.
#[derive(Clone, Debug)]
pub struct FirstRide {
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
    pub amount: i64,
    pub currency: String,
    pub origin_ip: IpNet,
    /// The server's `DEPLOYMENT_ID`, which the ride keeps (its charge's provider key and
    /// marker).
    pub deployment_id: String,
}

impl Rides {
    /// Phase `started`'s writes for a fresh key, made by the key's claim.
    pub(crate) fn first_ride(&self, params: RideParams, origin_ip: IpAddr) -> FirstRide {
        FirstRide {
            origin_lat: params.origin_lat,
            origin_lon: params.origin_lon,
            target_lat: params.target_lat,
            target_lon: params.target_lon,
            amount: self.price.amount,
            currency: self.price.currency.clone(),
            origin_ip: IpNet::from(origin_ip),
            deployment_id: self.stripe.deployment_id().as_str().to_owned(),
        }
    }
}

/// Declares a claim statement `$name` with `$sql`: both of CreateRide's claim statements begin
/// with `claim_find.sql`, so they bind the same arrays, one element per claim.
macro_rules! claim_statement {
    ($(#[$meta:meta])* struct $name:ident = $sql:expr;) => {
        schema::statement! {
            $(#[$meta])*
            struct $name = $sql;
            {
                token_digests: Array<Nullable<Bytea>> = Vec<Option<Vec<u8>>>,
                caller_ids: Array<Nullable<BigInt>> = Vec<Option<i64>>,
                keys: Array<Text> = Vec<String>,
                lock_tokens: Array<SqlUuid> = Vec<Uuid>,
                holders: Array<Nullable<BigInt>> = Vec<Option<i64>>,
                methods: Array<Text> = Vec<&'static str>,
                paths: Array<Text> = Vec<&'static str>,
                params: Array<Jsonb> = Vec<JsonText>,
                origin_lats: Array<Double> = Vec<f64>,
                origin_lons: Array<Double> = Vec<f64>,
                target_lats: Array<Double> = Vec<f64>,
                target_lons: Array<Double> = Vec<f64>,
                amounts: Array<BigInt> = Vec<i64>,
                currencies: Array<Text> = Vec<String>,
                origin_ips: Array<Cidr> = Vec<IpNet>,
                deployment_ids: Array<Text> = Vec<String>,
                lock_timeouts: Array<Double> = Vec<f64>,
                holder_takeovers: Array<Double> = Vec<f64>,
            }
        }

        impl $name {
            fn of(claims: &[ClaimRequest<FirstRide>]) -> $name {
                let rides = || claims.iter().map(|claim| &claim.first_phase);
                $name {
                    token_digests: claims.iter().map(|c| digest(c.caller)).collect(),
                    caller_ids: claims.iter().map(|c| user_id(c.caller)).collect(),
                    keys: claims.iter().map(|c| c.key.clone()).collect(),
                    lock_tokens: claims.iter().map(|c| c.lock.token).collect(),
                    holders: claims.iter().map(|c| c.lock.holder).collect(),
                    methods: claims.iter().map(|c| c.request.method).collect(),
                    paths: claims.iter().map(|c| c.request.path).collect(),
                    params: claims.iter().map(|c| c.request.params.clone()).collect(),
                    origin_lats: rides().map(|r| r.origin_lat).collect(),
                    origin_lons: rides().map(|r| r.origin_lon).collect(),
                    target_lats: rides().map(|r| r.target_lat).collect(),
                    target_lons: rides().map(|r| r.target_lon).collect(),
                    amounts: rides().map(|r| r.amount).collect(),
                    currencies: rides().map(|r| r.currency.clone()).collect(),
                    origin_ips: rides().map(|r| r.origin_ip).collect(),
                    deployment_ids: rides().map(|r| r.deployment_id.clone()).collect(),
                    lock_timeouts: claims.iter().map(|c| c.rule.secs().0).collect(),
                    holder_takeovers: claims.iter().map(|c| c.rule.secs().1).collect(),
                }
            }
        }
    };
}

claim_statement! {
    /// `claim_find.sql` then `claim.sql`: finds each claim's key, or inserts it with its ride.
    struct ClaimRides = concat!(include_str!("claim_find.sql"), include_str!("claim.sql"));
}

claim_statement! {
    /// `claim_find.sql` then `claim_read.sql`: finds each claim's key and writes nothing. The ride
    /// arrays are bound, and unused, so that both statements share `claim_find.sql` as it is.
    struct ClaimReads = concat!(include_str!("claim_find.sql"), include_str!("claim_read.sql"));
}

fn digest(caller: Caller) -> Option<Vec<u8>> {
    match caller {
        Caller::Token(digest) => Some(digest.to_vec()),
        Caller::OnBehalfOf(_) => None,
    }
}

fn user_id(caller: Caller) -> Option<i64> {
    match caller {
        Caller::Token(_) => None,
        Caller::OnBehalfOf(user_id) => Some(user_id),
    }
}

/// A row of either claim statement: the claim's caller and key, and the ride inserted with a new
/// key (never by `ClaimReads`).
#[derive(QueryableByName)]
struct ClaimedRide {
    #[diesel(embed)]
    claim: CallerAndKey,
    #[diesel(sql_type = Nullable<BigInt>)]
    ride_id: Option<i64>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    ride_created_at: Option<DateTime<Utc>>,
}

/// CreateRide's claim statement.
pub struct RideClaim;

impl ClaimStatement for RideClaim {
    type FirstPhase = FirstRide;
    type Written = Ride;

    async fn execute(
        &self,
        conn: &mut AsyncPgConnection,
        claims: &[ClaimRequest<FirstRide>],
    ) -> Result<Vec<Option<ClaimRow<Ride>>>, DieselError> {
        let rows: Vec<ClaimedRide> = ClaimRides::of(claims).load(conn).await?;
        Ok(in_claims_order(claims, rows))
    }

    async fn read(
        &self,
        conn: &mut AsyncPgConnection,
        claims: &[ClaimRequest<FirstRide>],
    ) -> Result<Vec<Option<ClaimRow<Ride>>>, DieselError> {
        let rows: Vec<ClaimedRide> = ClaimReads::of(claims).load(conn).await?;
        Ok(in_claims_order(claims, rows))
    }
}

/// A statement's rows as the engine wants them: per claim, in order, its row if there is one.
fn in_claims_order(
    claims: &[ClaimRequest<FirstRide>],
    rows: Vec<ClaimedRide>,
) -> Vec<Option<ClaimRow<Ride>>> {
    let mut rows: HashMap<Uuid, ClaimedRide> =
        rows.into_iter().map(|row| (row.claim.req, row)).collect();
    claims
        .iter()
        .map(|claim| {
            let row = rows.remove(&claim.lock.token)?;
            Some(row.into_claim_row(&claim.first_phase))
        })
        .collect()
}

impl ClaimedRide {
    /// The engine's row, with the ride as the statement inserted it from `first`.
    fn into_claim_row(self, first: &FirstRide) -> ClaimRow<Ride> {
        let (ride_id, ride_created_at) = (self.ride_id, self.ride_created_at);
        let mut row = self.claim.into_row(None);
        if let (Some(id), Some(created_at)) = (ride_id, ride_created_at) {
            row.written = Some(Ride {
                id,
                created_at,
                idempotency_key_id: Some(row.key.id),
                origin_lat: first.origin_lat,
                origin_lon: first.origin_lon,
                target_lat: first.target_lat,
                target_lon: first.target_lon,
                amount: first.amount,
                currency: first.currency.clone(),
                stripe_charge_id: None,
                user_id: row.user.id,
                deployment_id: Some(first.deployment_id.clone()),
            });
        }
        row
    }
}
