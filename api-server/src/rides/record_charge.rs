//! Phase `ride_created`: the charge, a foreign state mutation made with no transaction open and
//! no pooled connection held, then its result in one atomic phase: the PaymentIntent id on the
//! ride and the recovery point `charge_created` ([`RecordCharge`], or [`RecordChargeBatch`] for
//! several requests, see `create_ride_record`'s module doc for why and how phases batch), or, for
//! a declined card, the key finished with the decline as its outcome.

use std::time::{Duration, Instant};

use contract::Outcome;
use contract::key::KeyMoved;
use diesel::{
    OptionalExtension,
    result::Error as DieselError,
    sql_types::{self, Array, BigInt, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::FutureExt;
use schema::{
    models::Ride,
    prepared::{Statement, prepared},
    store::StoreError,
};
use scoped_futures::ScopedFutureExt;
use telemetry::attr;

use super::{CreateRideError, RideRequest, Rides};
use crate::{
    idempotency::{self, BatchStatement, Fence, FenceArrays, Lease},
    metrics::metrics,
    payments::{ChargeError, ChargeRequest},
};

impl Rides {
    /// Phase `ride_created`: the charge, then its result in one atomic phase: the ride with its
    /// charge recorded, or the final outcome if the card was declined.
    pub(super) async fn charge(
        &self,
        lease: &Lease,
        request: &RideRequest,
        ride: Ride,
    ) -> Result<Charged, CreateRideError> {
        let charge = ChargeRequest {
            amount: ride.amount,
            currency: ride.currency.clone(),
            customer: request.user.stripe_customer_id.clone(),
            payment_method: request.user.stripe_payment_method_id.clone(),
            description: format!("Rocket Rides ride {}", ride.id),
            metadata: vec![
                ("ride_id", ride.id.to_string()),
                ("user_id", ride.user_id.to_string()),
                ("idempotency_key_id", lease.key_id.to_string()),
            ],
            idempotency_key: contract::key::provider_idempotency_key(lease.key_id),
        };
        // No transaction is open and no connection is held here: the call may take seconds.
        let started = Instant::now();
        crate::fault::crash_point("charge.before_call");
        let charged = if self.beyond_provider_key_window(&ride) {
            // The provider may have forgotten our idempotency key: an earlier attempt that
            // charged but was never recorded would be charged again. Look for it first.
            match self.stripe.find_succeeded_charge(ride.id).await {
                Ok(Some(intent)) => {
                    tracing::warn!(
                        ride_id = ride.id,
                        "found an unrecorded charge older than the provider's idempotency window"
                    );
                    Ok(intent)
                }
                Ok(None) => self.stripe.create_payment_intent(&charge).await,
                Err(error) => Err(error),
            }
        } else {
            self.stripe.create_payment_intent(&charge).await
        };
        let outcome = match &charged {
            Ok(_) => "succeeded",
            Err(ChargeError::Declined { .. }) => "declined",
            Err(ChargeError::Unavailable { .. }) => "unavailable",
            Err(ChargeError::Rejected { .. }) => "rejected",
        };
        metrics()
            .provider_duration
            .record(started.elapsed().as_secs_f64(), &[attr("outcome", outcome)]);
        match charged {
            Ok(intent) => {
                crate::fault::crash_point("charge.after_success");
                self.record_charge(lease, ride.id, &intent.id).await?;
                Ok(Charged::Recorded(Ride {
                    stripe_charge_id: Some(intent.id),
                    ..ride
                }))
            }
            Err(ChargeError::Declined {
                message,
                decline_code,
                ..
            }) => {
                let outcome = Outcome::CardDeclined {
                    message,
                    decline_code,
                };
                idempotency::finish(&self.pool, self.retry, lease, &outcome.to_stored()).await?;
                Ok(Charged::Declined(outcome))
            }
            Err(error @ ChargeError::Unavailable { .. }) => {
                Err(CreateRideError::ProviderUnavailable(error))
            }
            Err(error @ ChargeError::Rejected { .. }) => {
                Err(CreateRideError::Internal(Box::new(error)))
            }
        }
    }

    /// The charge's atomic phase: the PaymentIntent id on the ride, and `charge_created`.
    async fn record_charge(
        &self,
        lease: &Lease,
        ride_id: i64,
        intent_id: &str,
    ) -> Result<(), StoreError> {
        let charge_made = || ChargeMade {
            fence: lease.fence(),
            ride_id,
            charge_id: intent_id.to_owned(),
        };
        idempotency::batched_phase(&self.charges, lease, charge_made, || async {
            idempotency::atomic_phase(&self.pool, self.retry, lease, |conn| {
                prepared::<RecordCharge, _>(|q| {
                    q.bind::<BigInt, _>(lease.key_id)
                        .bind::<sql_types::Uuid, _>(lease.token)
                        .bind::<BigInt, _>(lease.user_id)
                        .bind::<Text, _>(intent_id)
                        .bind::<BigInt, _>(ride_id)
                })
                .get_result::<KeyMoved>(conn)
                .map(OptionalExtension::optional)
                .scope_boxed()
            })
            .await
            .map(|_| ())
        })
        .await
    }

    /// Whether an attempt at charging `ride` may be older than the provider's idempotency window.
    /// Every attempt happened after the ride was created, so a ride younger than the window (less
    /// a tenth, for clock skew) proves the provider still remembers the key.
    fn beyond_provider_key_window(&self, ride: &Ride) -> bool {
        let window = self.stripe.idempotency_window();
        let safe = window.saturating_sub(window / 10);
        let age = (chrono::Utc::now() - ride.created_at)
            .to_std()
            .unwrap_or(Duration::ZERO);
        age >= safe
    }
}

/// How the charge phase ended.
pub(super) enum Charged {
    /// The charge is recorded on this ride; the key is at `charge_created`.
    Recorded(Ride),
    /// The card was declined; the key is finished with this outcome.
    Declined(Outcome),
}

/// The charge's atomic phase as one statement: the PaymentIntent id on the key's ride and the
/// recovery point `charge_created`. Its commit is not waited for (`contract::unflushed!`): lost in
/// a crash of PostgreSQL, the key is back at `ride_created` and the retry's charge is replayed by
/// the provider under the same key; the receipt phase's flushed commit makes it durable before the
/// caller is answered.
struct RecordCharge;

impl Statement for RecordCharge {
    const SQL: &'static str = concat!(
        "WITH ",
        contract::fence!("ride_created"),
        ", ",
        contract::unflushed!(),
        ", charged AS (UPDATE rides SET stripe_charge_id = $4 FROM fence CROSS JOIN unflushed \
         WHERE rides.id = $5 AND rides.user_id = fence.user_id \
         AND rides.idempotency_key_id = fence.id RETURNING rides.id) \
         UPDATE idempotency_keys SET recovery_point = 'charge_created' FROM charged \
         WHERE idempotency_keys.id = $1 AND idempotency_keys.lock_token = $2 \
         AND idempotency_keys.user_id = $3 RETURNING idempotency_keys.id"
    );
}

/// The charge's atomic phase for several keys: see [`RecordCharge`].
pub struct RecordCharges;

/// One request's part of [`RecordCharges`].
pub struct ChargeMade {
    pub fence: Fence,
    pub ride_id: i64,
    /// The provider's PaymentIntent id.
    pub charge_id: String,
}

impl BatchStatement for RecordCharges {
    type Item = ChargeMade;
    /// `Some` if the key moved on; `None` if its fence failed.
    type Output = Option<()>;
    const NAME: &'static str = "record_charge";
    /// Recording the same PaymentIntent id again changes nothing.
    const REDO_AFTER_CONNECTION_LOSS: bool = true;

    async fn execute(
        &self,
        conn: &mut AsyncPgConnection,
        items: &[ChargeMade],
    ) -> Result<Vec<Option<()>>, DieselError> {
        let fences = FenceArrays::of(items.iter().map(|item| item.fence));
        let charge_ids: Vec<&str> = items.iter().map(|item| item.charge_id.as_str()).collect();
        let ride_ids: Vec<i64> = items.iter().map(|item| item.ride_id).collect();
        let moved = prepared::<RecordChargeBatch, _>(|q| {
            q.bind::<Array<BigInt>, _>(&fences.key_ids)
                .bind::<Array<sql_types::Uuid>, _>(&fences.tokens)
                .bind::<Array<BigInt>, _>(&fences.user_ids)
                .bind::<Array<Text>, _>(&charge_ids)
                .bind::<Array<BigInt>, _>(&ride_ids)
        })
        .load::<KeyMoved>(conn)
        .await?;
        Ok(KeyMoved::per_item(items, |item| item.fence.key_id, moved))
    }
}

struct RecordChargeBatch;

impl Statement for RecordChargeBatch {
    const SQL: &'static str = concat!(
        contract::batch_fence!(
            "ride_created",
            "$4::text[], $5::int8[]",
            "charge_id, ride_id"
        ),
        ", ",
        contract::unflushed!(),
        ", charged AS (UPDATE rides SET stripe_charge_id = fence.charge_id \
         FROM fence CROSS JOIN unflushed \
         WHERE rides.id = ANY(ARRAY(SELECT ride_id FROM fence)) \
         AND rides.id = fence.ride_id AND rides.user_id = fence.user_id \
         AND rides.idempotency_key_id = fence.key_id \
         RETURNING rides.idempotency_key_id, rides.user_id) \
         UPDATE idempotency_keys SET recovery_point = 'charge_created' FROM charged \
         WHERE idempotency_keys.id = ANY(ARRAY(SELECT idempotency_key_id FROM charged)) \
         AND idempotency_keys.id = charged.idempotency_key_id \
         AND idempotency_keys.user_id = charged.user_id \
         RETURNING idempotency_keys.id"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recording the charge need not wait for the flush: the receipt phase's commit does
    /// (`contract::unflushed!`'s table).
    #[test]
    fn the_charge_is_recorded_without_waiting_for_the_flush() {
        for sql in [RecordCharge::SQL, RecordChargeBatch::SQL] {
            assert!(sql.contains(contract::unflushed!()), "{sql}");
            assert!(sql.contains("CROSS JOIN unflushed"), "{sql}");
        }
    }
}
