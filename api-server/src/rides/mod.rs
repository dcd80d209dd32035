//! CreateRide as a state machine over recovery points. Each arm is one atomic phase, or the
//! charge (a foreign state mutation, made with no transaction open and no pooled connection held)
//! followed by the atomic phase that records its result:
//!
//! ```text
//! claim ──► started ──tx──► ride_created ──charge──tx──► charge_created ──tx──► finished
//!                                           └─decline──tx──────────────────────────┘
//! ```
//!
//! A retry with the same key re-enters the loop at the key's recovery point; a finished key
//! replays the outcome stored by the last phase. This module decides *what* happens; the
//! idempotency engine (`crate::idempotency`) guarantees it happens once, and the gRPC layer
//! (`crate::grpc`) turns the result into a response. The three write phases go to the database
//! batched with other requests' same phase (`batched`).

mod batched;

use std::{
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl, SelectableHelper,
    sql_types::{self, BigInt, Cidr, Double, Integer, Jsonb, Text},
};
use diesel_async::RunQueryDsl;
use futures_util::FutureExt;
use ipnet::IpNet;
use schema::{
    Pool, RecoveryPoint, SEND_RIDE_RECEIPT_JOB,
    models::{Ride, User},
    prepared::{Statement, prepared},
    schema::rides,
};
use scoped_futures::ScopedFutureExt;
use serde::{Deserialize, Serialize};
use telemetry::attr;
use tracing::Instrument;

use crate::{
    config::{IdempotencyConfig, Price},
    idempotency::{
        self, BatchCounts, Batcher, Claim, ClaimBatcher, Claimed, IdempotencyKey, KeyMoved, Lease,
        RequestSignature, RetryPolicy, StoreError, StoredResponse,
    },
    metrics::metrics,
    payments::{ChargeError, ChargeRequest, StripeClient},
};

pub const CREATE_RIDE_METHOD: &str = "POST";
pub const CREATE_RIDE_PATH: &str = "/rides.v1.RideService/CreateRide";
pub const PAYMENT_ACCEPTED: &str = "Payment accepted. Your pilot is on their way!";

/// Stored response codes are gRPC status codes, because the stored outcome is replayed as the
/// same gRPC answer.
const CODE_OK: i32 = 0;
const CODE_FAILED_PRECONDITION: i32 = 9;

/// A ride request whose coordinates are finite and in range.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RideParams {
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
}

/// One field that failed validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldViolation {
    pub field: &'static str,
    pub description: String,
}

impl RideParams {
    /// Validates raw coordinates, reporting every bad field at once.
    pub fn new(
        origin_lat: Option<f64>,
        origin_lon: Option<f64>,
        target_lat: Option<f64>,
        target_lon: Option<f64>,
    ) -> Result<RideParams, Vec<FieldViolation>> {
        let mut violations = Vec::new();
        let mut check = |field: &'static str, value: Option<f64>, limit: f64| match value {
            None => {
                violations.push(FieldViolation {
                    field,
                    description: format!("{field} is required"),
                });
                0.0
            }
            Some(value) if !value.is_finite() => {
                violations.push(FieldViolation {
                    field,
                    description: format!("{field} must be a finite number"),
                });
                0.0
            }
            Some(value) if !(-limit..=limit).contains(&value) => {
                violations.push(FieldViolation {
                    field,
                    description: format!("{field} must be between -{limit} and {limit}"),
                });
                0.0
            }
            // -0.0 and 0.0 are the same place; storing one spelling keeps retries comparable.
            Some(value) => value + 0.0,
        };
        let params = RideParams {
            origin_lat: check("origin_lat", origin_lat, 90.0),
            origin_lon: check("origin_lon", origin_lon, 180.0),
            target_lat: check("target_lat", target_lat, 90.0),
            target_lon: check("target_lon", target_lon, 180.0),
        };
        if violations.is_empty() {
            Ok(params)
        } else {
            Err(violations)
        }
    }

    /// What the key is bound to: a retry must present the same.
    pub fn signature(&self) -> RequestSignature {
        RequestSignature {
            method: CREATE_RIDE_METHOD,
            path: CREATE_RIDE_PATH,
            params: serde_json::json!({
                "origin_lat": self.origin_lat,
                "origin_lon": self.origin_lon,
                "target_lat": self.target_lat,
                "target_lon": self.target_lon,
            }),
        }
    }
}

/// The `send_ride_receipt` job's arguments. Public because an operator finishing a key by hand
/// (`workers admin key finish`) must stage exactly what this service stages.
pub fn receipt_job_args(ride: &Ride) -> serde_json::Value {
    // Plain fields only: serialising cannot fail.
    serde_json::to_value(schema::jobs::ReceiptJobArgs::from(ride)).unwrap_or_default()
}

/// A ride as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RideView {
    pub id: i64,
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
    pub charge_id: Option<String>,
    pub amount: i64,
    pub currency: String,
    pub created_at: DateTime<Utc>,
}

impl From<Ride> for RideView {
    fn from(ride: Ride) -> RideView {
        RideView {
            id: ride.id,
            origin_lat: ride.origin_lat,
            origin_lon: ride.origin_lon,
            target_lat: ride.target_lat,
            target_lon: ride.target_lon,
            charge_id: ride.stripe_charge_id,
            amount: ride.amount,
            currency: ride.currency,
            created_at: ride.created_at,
        }
    }
}

/// A final outcome: stored on the key by the phase that reaches it, and replayed from there.
/// Fresh answers are built from the same stored value, so a replay is identical to the original.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    RideCreated {
        ride: RideView,
        message: String,
    },
    CardDeclined {
        message: String,
        decline_code: Option<String>,
    },
}

impl Outcome {
    /// The stored form (response code and body) that a replay is rebuilt from. Anything that
    /// finishes a key (the phases, an operator) must store exactly this.
    pub fn to_stored(&self) -> Result<StoredResponse, StoreError> {
        let code = match self {
            Outcome::RideCreated { .. } => CODE_OK,
            Outcome::CardDeclined { .. } => CODE_FAILED_PRECONDITION,
        };
        let body = serde_json::to_value(self).map_err(|_| StoreError::CorruptStoredResponse)?;
        Ok(StoredResponse { code, body })
    }

    pub fn from_stored(stored: StoredResponse) -> Result<Outcome, StoreError> {
        serde_json::from_value(stored.body).map_err(|_| StoreError::CorruptStoredResponse)
    }
}

/// Why a CreateRide attempt ended without a final outcome.
#[derive(Debug, thiserror::Error)]
pub enum CreateRideError {
    #[error("the idempotency key was used with different parameters")]
    KeyReused,
    #[error("another request with this idempotency key is in progress")]
    KeyInUse,
    #[error("another attempt took over this idempotency key")]
    LockLost,
    #[error("the request kept conflicting with concurrent requests")]
    Contended(#[source] StoreError),
    #[error("the database is unavailable")]
    DatabaseUnavailable(#[source] StoreError),
    #[error("the payment provider is unavailable")]
    ProviderUnavailable(#[source] ChargeError),
    #[error("internal error")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl From<StoreError> for CreateRideError {
    fn from(error: StoreError) -> CreateRideError {
        match error {
            StoreError::LockLost => CreateRideError::LockLost,
            error @ StoreError::Contended { .. } => CreateRideError::Contended(error),
            error @ (StoreError::Unavailable(_) | StoreError::ConnectionLost(_)) => {
                CreateRideError::DatabaseUnavailable(error)
            }
            error @ (StoreError::CorruptStoredResponse
            | StoreError::KeyVanished
            | StoreError::Database(_)) => CreateRideError::Internal(Box::new(error)),
        }
    }
}

/// What a CreateRide call answered.
#[derive(Debug)]
pub struct CreateRideReply {
    /// When the key will be reaped; absent only if the key could not be read at all.
    pub key_expires_at: Option<DateTime<Utc>>,
    pub replayed: bool,
    pub result: Result<Outcome, CreateRideError>,
}

/// The result of running one phase.
#[derive(Debug)]
pub enum Step {
    /// The key moved on to `lease.recovery_point`; run the next phase.
    Advanced,
    /// The key is finished with this outcome.
    Finished(Outcome),
}

/// Who asked, from where, for what.
#[derive(Clone, Debug)]
pub struct RideRequest {
    pub user: User,
    pub params: RideParams,
    pub origin_ip: IpAddr,
}

/// The ride service's domain logic, shared by every request.
pub struct Rides {
    pool: Pool,
    /// Groups concurrent claims by token into shared statements.
    claims: Arc<ClaimBatcher>,
    /// Group concurrent requests' write phases into shared statements, one batcher per phase.
    new_rides: Arc<Batcher<batched::CreateRideRecords>>,
    charges: Arc<Batcher<batched::RecordCharges>>,
    receipts: Arc<Batcher<batched::StageReceipts>>,
    stripe: StripeClient,
    price: Price,
    idempotency: IdempotencyConfig,
    retry: RetryPolicy,
}

impl Rides {
    pub fn new(
        pool: Pool,
        stripe: StripeClient,
        price: Price,
        idempotency: IdempotencyConfig,
    ) -> Arc<Rides> {
        let retry = RetryPolicy::default();
        Arc::new(Rides {
            claims: ClaimBatcher::for_claims(pool.clone(), retry, idempotency.claim_batching),
            new_rides: Batcher::new(
                batched::CreateRideRecords {
                    price: price.clone(),
                },
                pool.clone(),
                retry,
                idempotency.phase_batching,
            ),
            charges: Batcher::new(
                batched::RecordCharges,
                pool.clone(),
                retry,
                idempotency.phase_batching,
            ),
            receipts: Batcher::new(
                batched::StageReceipts,
                pool.clone(),
                retry,
                idempotency.phase_batching,
            ),
            pool,
            stripe,
            price,
            idempotency,
            retry,
        })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The claim batcher, whose counts tell how many claims shared statements.
    pub fn claim_batcher(&self) -> &ClaimBatcher {
        &self.claims
    }

    /// How many requests' write phases shared statements: the three phases' counts, added up.
    pub fn phase_batch_counts(&self) -> BatchCounts {
        [
            self.new_rides.counts(),
            self.charges.counts(),
            self.receipts.counts(),
        ]
        .into_iter()
        .fold(
            BatchCounts {
                statements: 0,
                items: 0,
            },
            |sum, counts| BatchCounts {
                statements: sum.statements + counts.statements,
                items: sum.items + counts.items,
            },
        )
    }

    /// Runs CreateRide to a final outcome or an error, claiming the key first. On any error that
    /// leaves the key unfinished the key is unlocked, so a retry resumes at once.
    pub async fn create_ride(
        &self,
        key: &IdempotencyKey,
        request: &RideRequest,
    ) -> CreateRideReply {
        let claimed = idempotency::claim(
            &self.pool,
            self.retry,
            request.user.id,
            key,
            &request.params.signature(),
            self.idempotency.lock_timeout,
        )
        .await;
        self.answer(claimed, request).await
    }

    /// CreateRide for the owner of the API token whose digest is `token_digest`, authenticated
    /// by the claim's own statement (one round trip for a new key, a replay or a mismatch).
    /// `None` if no user has this token; nothing is written then. Otherwise the reply, with the
    /// caller's user id unless the claim failed before it was known.
    pub async fn authenticate_and_create_ride(
        &self,
        token_digest: &[u8; 32],
        key: &IdempotencyKey,
        params: RideParams,
        origin_ip: IpAddr,
    ) -> Option<(Option<i64>, CreateRideReply)> {
        let claimed = idempotency::authenticate_and_claim(
            &self.pool,
            &self.claims,
            self.retry,
            token_digest,
            key,
            &params.signature(),
            self.idempotency.lock_timeout,
        )
        .await;
        match claimed {
            Ok(None) => None,
            Ok(Some((user, claimed))) => {
                let user_id = user.id;
                let request = RideRequest {
                    user,
                    params,
                    origin_ip,
                };
                Some((Some(user_id), self.answer(Ok(claimed), &request).await))
            }
            Err(error) => Some((
                None,
                CreateRideReply {
                    key_expires_at: None,
                    replayed: false,
                    result: Err(error.into()),
                },
            )),
        }
    }

    /// Acts on a claim: refuses, replays, or runs the key to a final outcome.
    async fn answer(
        &self,
        claimed: Result<Claimed, StoreError>,
        request: &RideRequest,
    ) -> CreateRideReply {
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(error) => {
                return CreateRideReply {
                    key_expires_at: None,
                    replayed: false,
                    result: Err(error.into()),
                };
            }
        };
        let key_expires_at = claimed
            .key_created_at
            .checked_add_signed(idempotency::chrono_duration(self.idempotency.key_ttl));
        let (replayed, result) = match claimed.claim {
            Claim::Mismatch => (false, Err(CreateRideError::KeyReused)),
            Claim::InUse => {
                metrics().lock_conflicts.add(1, &[attr("kind", "in_use")]);
                (false, Err(CreateRideError::KeyInUse))
            }
            Claim::Replay(stored) => {
                metrics().replays.add(1, &[]);
                (true, Outcome::from_stored(stored).map_err(Into::into))
            }
            Claim::Execute(mut lease) => {
                crate::fault::crash_point("claim.after_commit");
                (false, self.run(&mut lease, request).await)
            }
        };
        if matches!(result, Err(CreateRideError::LockLost)) {
            metrics()
                .lock_conflicts
                .add(1, &[attr("kind", "lock_lost")]);
        }
        CreateRideReply {
            key_expires_at,
            replayed,
            result,
        }
    }

    /// Drives a claimed key to a final outcome.
    async fn run(
        &self,
        lease: &mut Lease,
        request: &RideRequest,
    ) -> Result<Outcome, CreateRideError> {
        let result = async {
            // The ride as the last phase left it, so that the next phase need not read it back.
            let mut ride = None;
            loop {
                if let Step::Finished(outcome) = self.step_with(lease, request, &mut ride).await? {
                    return Ok(outcome);
                }
            }
        }
        .await;
        if let Err(error) = &result
            && !matches!(error, CreateRideError::LockLost)
            && let Err(release_error) = idempotency::release(&self.pool, self.retry, lease).await
        {
            // The lock expires by itself; a retry just waits for it.
            tracing::warn!(error = %release_error, key_id = lease.key_id, "could not unlock key");
        }
        result
    }

    /// Runs the phase for `lease.recovery_point` and advances the lease, as an attempt that
    /// resumes there does (it reads the ride if the phase needs it). Public so that tests can stop
    /// an attempt between phases, as a crash would.
    pub async fn step(
        &self,
        lease: &mut Lease,
        request: &RideRequest,
    ) -> Result<Step, CreateRideError> {
        self.step_with(lease, request, &mut None).await
    }

    /// [`Rides::step`] with the ride the previous phase of this attempt left in `ride` (or `None`
    /// to read it), leaving the ride there for the next phase. Public so that tests can run a
    /// phase without its read.
    pub async fn step_with(
        &self,
        lease: &mut Lease,
        request: &RideRequest,
        ride: &mut Option<Ride>,
    ) -> Result<Step, CreateRideError> {
        let point = lease.recovery_point;
        let span = tracing::info_span!(
            "phase",
            otel.name = %format_args!("phase {point}"),
            db.system.name = "postgresql",
            rides.recovery_point.from = %point,
            rides.recovery_point.to = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        let started = Instant::now();
        let result = self
            .run_phase(lease, request, ride)
            .instrument(span.clone())
            .await;
        span.record("rides.recovery_point.to", lease.recovery_point.as_str());
        if result.is_err() {
            span.record("otel.status_code", "ERROR");
        }
        metrics().phase_duration.record(
            started.elapsed().as_secs_f64(),
            &[
                attr("rides.phase", point.as_str()),
                attr("outcome", if result.is_ok() { "ok" } else { "error" }),
            ],
        );
        result
    }

    async fn run_phase(
        &self,
        lease: &mut Lease,
        request: &RideRequest,
        ride: &mut Option<Ride>,
    ) -> Result<Step, CreateRideError> {
        let point = lease.recovery_point;
        let step = match point {
            RecoveryPoint::Started => {
                *ride = Some(self.create_ride_record(lease, request).await?);
                lease.recovery_point = RecoveryPoint::RideCreated;
                Step::Advanced
            }
            RecoveryPoint::RideCreated => {
                let current = self.current_ride(lease, ride.take()).await?;
                match self.charge(lease, request, current).await? {
                    Charged::Recorded(charged) => {
                        *ride = Some(charged);
                        lease.recovery_point = RecoveryPoint::ChargeCreated;
                        Step::Advanced
                    }
                    Charged::Declined(outcome) => Step::Finished(outcome),
                }
            }
            RecoveryPoint::ChargeCreated => {
                let current = self.current_ride(lease, ride.take()).await?;
                Step::Finished(self.stage_receipt(lease, current).await?)
            }
            RecoveryPoint::Finished => {
                return Err(CreateRideError::Internal(
                    "a finished key cannot be run again".into(),
                ));
            }
        };
        if matches!(step, Step::Finished(_)) {
            lease.recovery_point = RecoveryPoint::Finished;
        }
        tracing::debug!(key_id = lease.key_id, from = %point, to = %lease.recovery_point, "phase committed");
        Ok(step)
    }

    /// The key's ride: the one this attempt's previous phase returned, or else read back (an
    /// attempt that resumes a key). Reading it outside the next phase's statement is safe: only
    /// the holder of the key's lock changes a ride, by the phase that records the charge, and a
    /// lease that lost the lock meanwhile is fenced off by that next phase.
    async fn current_ride(
        &self,
        lease: &Lease,
        ride: Option<Ride>,
    ) -> Result<Ride, CreateRideError> {
        match ride {
            Some(ride) => Ok(ride),
            None => self.ride_for_key(lease.key_id).await,
        }
    }

    /// Phase `started`: the ride and its audit record.
    async fn create_ride_record(
        &self,
        lease: &Lease,
        request: &RideRequest,
    ) -> Result<Ride, StoreError> {
        let params = request.params;
        let origin_ip = IpNet::from(request.origin_ip);
        let data = serde_json::to_value(params).unwrap_or_default();
        let new_ride = || batched::NewRide {
            key_id: lease.key_id,
            token: lease.token,
            user_id: lease.user_id,
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
                    .bind::<Double, _>(params.origin_lat)
                    .bind::<Double, _>(params.origin_lon)
                    .bind::<Double, _>(params.target_lat)
                    .bind::<Double, _>(params.target_lon)
                    .bind::<BigInt, _>(price.amount)
                    .bind::<Text, _>(price.currency.as_str())
                    .bind::<BigInt, _>(lease.user_id)
                    .bind::<Jsonb, _>(data)
                    .bind::<Cidr, _>(origin_ip)
            })
            .get_result::<Ride>(conn)
            .map(OptionalExtension::optional)
            .scope_boxed()
        })
        .await
    }

    /// Phase `ride_created`: the charge, then its result in one atomic phase: the ride with its
    /// charge recorded, or the final outcome if the card was declined.
    async fn charge(
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
            idempotency_key: crate::payments::provider_idempotency_key(lease.key_id),
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
                idempotency::finish(&self.pool, self.retry, lease, &outcome.to_stored()?).await?;
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
        let charge_made = || batched::ChargeMade {
            key_id: lease.key_id,
            token: lease.token,
            ride_id,
            charge_id: intent_id.to_owned(),
        };
        idempotency::batched_phase(&self.charges, lease, charge_made, || async {
            idempotency::atomic_phase(&self.pool, self.retry, lease, |conn| {
                prepared::<RecordCharge, _>(|q| {
                    q.bind::<BigInt, _>(lease.key_id)
                        .bind::<sql_types::Uuid, _>(lease.token)
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

    /// Phase `charge_created`: the receipt job and the stored response, then finished.
    async fn stage_receipt(&self, lease: &Lease, ride: Ride) -> Result<Outcome, StoreError> {
        // The receipt continues this request's trace: the enqueuer and the receipt worker pick
        // the context up from the job.
        let trace_context = serde_json::to_value(telemetry::inject_current()).unwrap_or_default();
        let job_args = receipt_job_args(&ride);
        let outcome = Outcome::RideCreated {
            ride: RideView::from(ride),
            message: PAYMENT_ACCEPTED.to_owned(),
        };
        let stored = outcome.to_stored()?;
        let receipt_due = || batched::ReceiptDue {
            key_id: lease.key_id,
            token: lease.token,
            job_args: job_args.clone(),
            trace_context: trace_context.clone(),
            response_code: stored.code,
            response_body: stored.body.clone(),
        };
        let (trace_context, job_args, stored) = (&trace_context, &job_args, &stored);
        idempotency::batched_phase(&self.receipts, lease, receipt_due, || async {
            idempotency::atomic_phase(&self.pool, self.retry, lease, |conn| {
                prepared::<StageReceipt, _>(|q| {
                    q.bind::<BigInt, _>(lease.key_id)
                        .bind::<sql_types::Uuid, _>(lease.token)
                        .bind::<Text, _>(SEND_RIDE_RECEIPT_JOB)
                        .bind::<Jsonb, _>(job_args)
                        .bind::<Jsonb, _>(trace_context)
                        .bind::<Integer, _>(stored.code)
                        .bind::<Jsonb, _>(&stored.body)
                })
                .get_result::<KeyMoved>(conn)
                .map(OptionalExtension::optional)
                .scope_boxed()
            })
            .await
            .map(|_| ())
        })
        .await?;
        Ok(outcome)
    }

    async fn ride_for_key(&self, key_id: i64) -> Result<Ride, CreateRideError> {
        let mut conn = self.pool.get().await.map_err(|error| {
            CreateRideError::DatabaseUnavailable(StoreError::Unavailable(error))
        })?;
        rides::table
            .filter(rides::idempotency_key_id.eq(key_id))
            .select(Ride::as_select())
            .first(&mut conn)
            .await
            // Through StoreError, so that a lost connection is UNAVAILABLE like everywhere else.
            .map_err(|error| StoreError::from(error).into())
    }

    /// One of `user_id`'s own rides; `None` for anyone else's or an unknown id.
    pub async fn get_ride(
        &self,
        user_id: i64,
        ride_id: i64,
    ) -> Result<Option<RideView>, StoreError> {
        let mut conn = self.pool.get().await.map_err(StoreError::Unavailable)?;
        let ride = rides::table
            .filter(rides::id.eq(ride_id))
            .filter(rides::user_id.eq(user_id))
            .select(Ride::as_select())
            .first(&mut conn)
            .await
            .optional()?;
        Ok(ride.map(RideView::from))
    }
}

/// How the charge phase ended.
enum Charged {
    /// The charge is recorded on this ride; the key is at `charge_created`.
    Recorded(Ride),
    /// The card was declined; the key is finished with this outcome.
    Declined(Outcome),
}

/// Phase `started` as one statement: the ride, its audit record and the recovery point
/// `ride_created`, each step selecting from the one before so that a failed fence writes nothing;
/// returns the ride.
struct CreateRideRecord;

impl Statement for CreateRideRecord {
    const SQL: &'static str = concat!(
        "WITH ",
        idempotency::fence!(),
        ", ride AS (INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, user_id) \
         SELECT fence.id, $3, $4, $5, $6, $7, $8, $9 FROM fence \
         RETURNING id, created_at, idempotency_key_id, origin_lat, origin_lon, target_lat, \
         target_lon, amount, currency, stripe_charge_id, user_id), \
         audit AS (INSERT INTO audit_records (action, data, origin_ip, resource_id, \
         resource_type, user_id) \
         SELECT 'ride.created', $10, $11, ride.id, 'ride', ride.user_id FROM ride) \
         UPDATE idempotency_keys SET recovery_point = 'ride_created' FROM ride \
         WHERE idempotency_keys.id = $1 AND idempotency_keys.lock_token = $2 RETURNING ride.*"
    );
}

/// The charge's atomic phase as one statement: the PaymentIntent id on the key's ride and the
/// recovery point `charge_created`.
struct RecordCharge;

impl Statement for RecordCharge {
    const SQL: &'static str = concat!(
        "WITH ",
        idempotency::fence!(),
        ", charged AS (UPDATE rides SET stripe_charge_id = $3 FROM fence \
         WHERE rides.id = $4 AND rides.idempotency_key_id = fence.id RETURNING rides.id) \
         UPDATE idempotency_keys SET recovery_point = 'charge_created' FROM charged \
         WHERE idempotency_keys.id = $1 AND idempotency_keys.lock_token = $2 \
         RETURNING idempotency_keys.id"
    );
}

/// Phase `charge_created` as one statement: the receipt job, then the key finished with the
/// stored response and unlocked.
struct StageReceipt;

impl Statement for StageReceipt {
    const SQL: &'static str = concat!(
        "WITH ",
        idempotency::fence!(),
        ", job AS (INSERT INTO staged_jobs (job_name, job_args, trace_context) \
         SELECT $3, $4, $5 FROM fence RETURNING id) ",
        idempotency::finish_key!("$6", "$7"),
        " FROM job WHERE idempotency_keys.id = $1 AND idempotency_keys.lock_token = $2 \
         RETURNING idempotency_keys.id"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_every_bad_field() {
        let violations =
            RideParams::new(None, Some(f64::NAN), Some(90.5), Some(-180.0)).unwrap_err();
        let fields: Vec<_> = violations.iter().map(|v| v.field).collect();
        assert_eq!(fields, ["origin_lat", "origin_lon", "target_lat"]);
        assert!(RideParams::new(Some(f64::INFINITY), Some(0.0), Some(0.0), Some(0.0)).is_err());
        assert!(RideParams::new(Some(-90.0), Some(180.0), Some(90.0), Some(-180.0)).is_ok());
    }

    #[test]
    fn negative_zero_is_stored_as_zero() {
        let params = RideParams::new(Some(-0.0), Some(0.0), Some(1.0), Some(1.0)).unwrap();
        assert!(params.origin_lat.is_sign_positive());
    }

    #[test]
    fn outcomes_round_trip_through_storage() {
        let outcome = Outcome::CardDeclined {
            message: "Your card was declined.".into(),
            decline_code: Some("generic_decline".into()),
        };
        let stored = outcome.to_stored().unwrap();
        assert_eq!(stored.code, CODE_FAILED_PRECONDITION);
        assert_eq!(Outcome::from_stored(stored).unwrap(), outcome);
    }
}
