//! Phase `ride_created`: the charge, a foreign state mutation made with no transaction open and
//! no pooled connection held, then its result in one atomic phase that finishes the key: for a
//! charge that succeeded, the PaymentIntent id on the ride, the receipt staged and the outcome
//! stored (`contract::writes::RecordCharge`, the statement `workers admin key finish` records a
//! charge with too), so the key goes from `ride_created` to `finished` in one commit and never
//! stops at `charge_created`; for a declined card, the key finished with the decline as its
//! outcome (`contract::writes::FinishKey`).
//!
//! The record goes through a [`Batcher`] with other requests' records: more than half of what
//! PostgreSQL spends on a ride is the fixed price of its statements (start, relation locks, one
//! commit with its WAL flush), not their rows. A request whose lease was taken over writes
//! nothing and gets no row back (`StoreError::LockLost`), while the other requests in the batch
//! commit.

use std::time::{Duration, Instant};

use contract::{
    BackgroundJob, Outcome, ReceiptJob,
    ownership::{
        self, IntentFacts, KeyRecord, METADATA_DEPLOYMENT_ID, METADATA_KEY_ID, METADATA_RIDE_ID,
        METADATA_USER_ID,
    },
    writes::{ChargeRecord, RecordCharge},
};
use diesel::result::Error as DieselError;
use diesel_async::AsyncPgConnection;
use provider::{ChargeError, ChargeRequest, PaymentIntent};
use schema::{RecoveryPoint, models::Ride, store::StoreError};
use telemetry::attr;

use super::{CreateRideError, RideRequest, Rides};
use crate::{
    fault::CrashPoint,
    idempotency::{self, BatchStatement, Lease},
    metrics::metrics,
};

/// The charge of `ride` for the key `lease` holds: every attempt at that ride, by any process,
/// asks the provider for exactly this, under the same idempotency key. A ride created under a
/// deployment id carries it as the charge's marker and in its provider key; a ride from before
/// deployment ids sends exactly what the older server sent (no marker, the old provider key), as
/// the provider refuses a retry whose parameters differ and charges again under another key.
pub(crate) fn charge_request(lease: &Lease, request: &RideRequest, ride: &Ride) -> ChargeRequest {
    let deployment_id = ride.deployment_id.as_deref();
    let mut metadata = vec![
        (METADATA_RIDE_ID, ride.id.to_string()),
        (METADATA_USER_ID, ride.user_id.to_string()),
        (METADATA_KEY_ID, lease.key_id.to_string()),
    ];
    if let Some(deployment_id) = deployment_id {
        metadata.push((METADATA_DEPLOYMENT_ID, deployment_id.to_owned()));
    }
    ChargeRequest {
        amount: ride.amount,
        currency: ride.currency.clone(),
        customer: request.user.stripe_customer_id.clone(),
        payment_method: request.user.stripe_payment_method_id.clone(),
        description: format!("Rocket Rides ride {}", ride.id),
        metadata,
        idempotency_key: contract::key::provider_idempotency_key(deployment_id, lease.key_id),
    }
}

/// The first of `found` (the provider's PaymentIntents naming `ride`) that succeeded and that the
/// ownership rule proves this key's charge; the others are someone else's and are only counted.
fn our_charge(
    deployment_id: &str,
    lease: &Lease,
    request: &RideRequest,
    ride: &Ride,
    found: Vec<PaymentIntent>,
) -> Option<PaymentIntent> {
    let key = KeyRecord {
        key_id: lease.key_id,
        deployment_id: ride.deployment_id.as_deref(),
        customer: &request.user.stripe_customer_id,
        ride_id: ride.id,
        amount: ride.amount,
        currency: &ride.currency,
    };
    found.into_iter().find(|intent| {
        let facts = IntentFacts {
            metadata: &intent.metadata,
            customer: intent.customer.as_deref(),
            amount: intent.amount,
            currency: &intent.currency,
        };
        match ownership::verdict(deployment_id, &facts, Some(&key)) {
            Ok(()) => intent.status == "succeeded",
            Err(why) => {
                metrics()
                    .foreign_charges
                    .add(1, &[attr("reason", why.as_str())]);
                tracing::warn!(
                    ride_id = ride.id,
                    payment_intent = %intent.id,
                    reason = %why,
                    "charge search: a PaymentIntent naming this ride is not ours; ignored"
                );
                false
            }
        }
    })
}

impl Rides {
    /// Phase `ride_created`: the charge, then its result in one atomic phase that finishes the
    /// key: the ride charged and its receipt staged, or the decline if the card was declined.
    /// `resumed`: the key was claimed by an earlier attempt, whose charge may have been refunded.
    pub(super) async fn charge(
        &self,
        lease: &Lease,
        request: &RideRequest,
        ride: Ride,
        resumed: bool,
    ) -> Result<Outcome, CreateRideError> {
        let ours = self.stripe.deployment_id().as_str();
        if let Some(other) = ride.deployment_id.as_deref().filter(|id| *id != ours) {
            // A ride another deployment created (a database restored or shared under another
            // DEPLOYMENT_ID): its provider key and marker are that deployment's, and charging
            // under them could replay or repeat that deployment's charge. Do not move money.
            return Err(CreateRideError::Internal(
                format!(
                    "ride {} was created by deployment {other:?}, this is {ours:?}",
                    ride.id
                )
                .into(),
            ));
        }
        self.fence_by_liveness(lease, LivenessStep::Charge).await?;
        let charged = self.call_provider(lease, request, &ride).await;
        if matches!(charged, Ok(_) | Err(ChargeError::Declined { .. })) {
            self.fence_by_liveness(lease, LivenessStep::Record).await?;
        }
        match charged {
            Ok(intent) => {
                crate::fault::crash_point(CrashPoint::ChargeAfterSuccess);
                if resumed && let Some(refunded) = self.refunded(lease, &ride, &intent).await? {
                    return Ok(refunded);
                }
                Ok(self.record_charge(lease, ride, intent.id).await?)
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
                Ok(outcome)
            }
            Err(error @ ChargeError::Unavailable { .. }) => {
                Err(CreateRideError::ProviderUnavailable(error))
            }
            Err(error @ ChargeError::Rejected { .. }) => {
                Err(CreateRideError::Internal(Box::new(error)))
            }
        }
    }

    /// The provider call of the charge, timed by its outcome: a search first for a ride older
    /// than the provider's idempotency window, then the PaymentIntent. No transaction is open and
    /// no connection is held here: the call may take seconds.
    async fn call_provider(
        &self,
        lease: &Lease,
        request: &RideRequest,
        ride: &Ride,
    ) -> Result<PaymentIntent, ChargeError> {
        let ours = self.stripe.deployment_id().as_str();
        let charge = charge_request(lease, request, ride);
        let started = Instant::now();
        crate::fault::crash_point(CrashPoint::ChargeBeforeCall);
        let charged = if self.beyond_provider_key_window(ride) {
            // The provider may have forgotten our idempotency key: an earlier attempt that
            // charged but was never recorded would be charged again. Look for it first.
            let found = self
                .stripe
                .search_charges_for_ride(ride.id)
                .await
                .map(|found| our_charge(ours, lease, request, ride, found));
            match found {
                Ok(Some(intent)) => {
                    tracing::warn!(
                        ride_id = ride.id,
                        "found an unrecorded charge older than the provider's idempotency window"
                    );
                    Ok(intent)
                }
                Ok(None) => self.create_payment_intent(&charge).await,
                Err(error) => Err(error),
            }
        } else {
            self.create_payment_intent(&charge).await
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
        charged
    }

    /// A resumed key's charge may be a replay of a PaymentIntent that was refunded meanwhile: a
    /// refund whose recording commit was lost leaves its key resumable, and the provider answers
    /// the retry with the refunded PaymentIntent. A refunded charge never pays for a ride
    /// (docs/money-safety.md). Refunded in full, the key is finished with the refunded-key
    /// outcome, and nothing is recorded or mailed. Refunded in part, or when the provider cannot
    /// say, nothing is written and the key stays unfinished for a person (the refund's finding
    /// is still open; the completer gives the key up). The provider unavailable for the read
    /// writes nothing either, and is answered as a failed charge is: a retry reads again.
    /// `None`: not refunded, record it.
    async fn refunded(
        &self,
        lease: &Lease,
        ride: &Ride,
        intent: &PaymentIntent,
    ) -> Result<Option<Outcome>, CreateRideError> {
        let not_recorded = |why: String| {
            tracing::error!(ride_id = ride.id, payment_intent = %intent.id, %why, "charge not recorded: see `workers admin findings list`");
            CreateRideError::Internal(
                format!("PaymentIntent {} of ride {}: {why}", intent.id, ride.id).into(),
            )
        };
        let unknown = |error: provider::ProviderError| match error {
            provider::ProviderError::Unavailable { reason, source } => {
                CreateRideError::ProviderUnavailable(ChargeError::Unavailable {
                    reason: format!("whether the charge was refunded cannot be read: {reason}"),
                    in_flight: false,
                    source,
                })
            }
            rejected @ provider::ProviderError::Rejected { .. } => {
                not_recorded(format!("whether it was refunded is unknown ({rejected})"))
            }
        };
        let listed = self.stripe.retrieve_payment_intent(&intent.id).await;
        match listed
            .map_err(unknown)?
            .and_then(|listed| listed.amount_refunded())
        {
            Some(0) => return Ok(None),
            Some(refunded) if refunded >= intent.amount => {}
            Some(refunded) => {
                return Err(not_recorded(format!(
                    "refunded in part ({refunded} of {})",
                    intent.amount
                )));
            }
            None => return Err(not_recorded("its refunds cannot be read".to_owned())),
        }
        let refunds = self
            .stripe
            .list_refunds(&intent.id)
            .await
            .map_err(unknown)?;
        let Some(refund) = refunds
            .into_iter()
            .find(|refund| refund.status == "succeeded")
        else {
            return Err(not_recorded("refunded, but no refund succeeded".to_owned()));
        };
        tracing::warn!(ride_id = ride.id, payment_intent = %intent.id, refund = %refund.id, "a resumed key's charge was refunded: the key is finished as refunded");
        let outcome = Outcome::PaymentRefunded {
            ride_id: Some(ride.id),
            payment_intent: intent.id.clone(),
            refund_id: refund.id,
            message: contract::outcome::PAYMENT_REFUNDED.to_owned(),
        };
        idempotency::finish(&self.pool, self.retry, lease, &outcome.to_stored()).await?;
        Ok(Some(outcome))
    }

    /// The charge's atomic phase, which is also phase `charge_created`'s: the PaymentIntent
    /// `charge_id` on `ride`, the receipt staged and the key finished. Both recovery points'
    /// crash points fire around the one statement, as `started`'s fire around the claim. Built
    /// inside the phase's span: the receipt continues this request's trace (the enqueuer and the
    /// receipt worker pick the context up from the job).
    async fn record_charge(
        &self,
        lease: &Lease,
        ride: Ride,
        charge_id: String,
    ) -> Result<Outcome, StoreError> {
        let ride = Ride {
            stripe_charge_id: Some(charge_id.clone()),
            ..ride
        };
        let (ride_id, receipt) = (ride.id, ReceiptJob::from(&ride).staged());
        let outcome = Outcome::ride_created(ride);
        let record = ChargeRecord {
            fence: lease.fence(),
            from: RecoveryPoint::RideCreated,
            ride_id,
            charge_id,
            receipt: Some(receipt),
            outcome: outcome.to_stored(),
        };
        crate::fault::crash_point(CrashPoint::ChargeCreatedBeforeCommit);
        idempotency::phase(&self.charges, lease, record).await?;
        crate::fault::crash_point(CrashPoint::ChargeCreatedAfterCommit);
        Ok(outcome)
    }

    /// The charge, waiting a little for an earlier request with the same provider key that the
    /// provider is still running (409 `idempotency_key_in_use`): after a takeover that is the
    /// dead holder's charge, whose result the provider then replays. Up to [`IN_FLIGHT_WAIT`],
    /// so that a rider whose holder died mid-charge is answered now rather than told to retry.
    async fn create_payment_intent(
        &self,
        charge: &ChargeRequest,
    ) -> Result<PaymentIntent, ChargeError> {
        let give_up = Instant::now() + IN_FLIGHT_WAIT;
        let mut pause = Duration::from_millis(50);
        loop {
            let charged = self.stripe.create_payment_intent(charge).await;
            let in_flight = matches!(
                charged,
                Err(ChargeError::Unavailable {
                    in_flight: true,
                    ..
                })
            );
            if !in_flight || Instant::now() + pause > give_up {
                return charged;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Whether an attempt at charging `ride` may be older than the provider's idempotency window
    /// (`contract::key::provider_key_margin`: the rule a takeover of a dead holder's key obeys
    /// too).
    fn beyond_provider_key_window(&self, ride: &Ride) -> bool {
        let safe = contract::key::provider_key_margin(self.stripe.idempotency_window());
        let age = (chrono::Utc::now() - ride.created_at)
            .to_std()
            .unwrap_or(Duration::ZERO);
        age >= safe
    }

    /// The holder's own fence (`schema::liveness`): a lease whose lock named a holder goes on
    /// only while that liveness session stands, since once it is gone another attempt may take
    /// the key over at once. A lease that named no holder is judged by the lock timeout alone,
    /// which outlasts the provider call.
    async fn fence_by_liveness(
        &self,
        lease: &Lease,
        step: LivenessStep,
    ) -> Result<(), CreateRideError> {
        let Some(holder) = lease.holder else {
            return Ok(());
        };
        let standing = match step {
            LivenessStep::Charge => self.locking.liveness.confirm(holder).await,
            LivenessStep::Record => self.locking.liveness.still_holds(holder),
        };
        if standing {
            return Ok(());
        }
        let step = step.name();
        metrics().liveness_fenced.add(1, &[attr("step", step)]);
        tracing::warn!(
            key_id = lease.key_id,
            step,
            "this process's liveness session is gone; leaving the key to another attempt"
        );
        Err(CreateRideError::LivenessLost)
    }
}

/// How long a charge waits for an earlier request with its provider key to finish at the
/// provider (a takeover's charge, while the dead holder's is still running there).
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(3);

/// Where the holder checks its liveness session.
#[derive(Clone, Copy, Debug)]
enum LivenessStep {
    /// Before the provider call: the session must be confirmed by a recent heartbeat (after a
    /// pause, the next one is waited for).
    Charge,
    /// Before recording the call's result: the session must not be known lost. A paused holder
    /// whose session survived records what it charged; one whose key was taken over meanwhile
    /// is refused by the fence.
    Record,
}

impl LivenessStep {
    fn name(self) -> &'static str {
        match self {
            LivenessStep::Charge => "charge",
            LivenessStep::Record => "record",
        }
    }
}

/// The charge's record ([`RecordCharge`]) as the batched statement of phase `ride_created`.
pub struct RecordCharges;

impl BatchStatement for RecordCharges {
    type Item = ChargeRecord;
    /// `Some` if the key was finished; `None` if its fence failed.
    type Output = Option<()>;
    const NAME: &'static str = "record_charge";
    /// A batch that committed finished and unlocked its keys, so a redo fails every fence and
    /// records and stages nothing twice.
    const REDO_AFTER_CONNECTION_LOSS: bool = true;

    async fn execute(
        &self,
        conn: &mut AsyncPgConnection,
        items: &[ChargeRecord],
    ) -> Result<Vec<Option<()>>, DieselError> {
        let moved = RecordCharge::run(conn, items).await?;
        Ok(moved.into_iter().map(|moved| moved.then_some(())).collect())
    }
}
