//! CreateRide as a state machine over recovery points. A fresh key's claim commits phase
//! `started` with the key; the charge (a foreign state mutation, made with no transaction open and
//! no pooled connection held) is followed by the one atomic phase that records its result and
//! finishes the key:
//!
//! ```text
//! claim+started ──tx──► ride_created ──charge──tx──► finished   (charge_created in the same tx)
//!                                     └─decline──tx──┘
//! ```
//!
//! So a new ride makes two commits: the claim writes the ride with the key in one statement
//! ([`claim`]), so the key is born at `ride_created`, and the statement that records the charge
//! also stages the receipt and finishes the key, so it never stops at `charge_created`. A key at
//! `started` or `charge_created` was left by an older server that committed those phases apart:
//! this server answers it `UNAVAILABLE` ([`CreateRideError::LeftByOlderServer`]), and `workers
//! admin keys upgrade` retires or finishes it (docs/operations.md, "Upgrading").
//!
//! A retry with the same key re-enters the loop at the key's recovery point; a finished key
//! replays the outcome stored by the last phase (`contract::Outcome`). This module decides *what*
//! happens; the idempotency engine (`crate::idempotency`) guarantees it happens once, and the gRPC
//! layer (`crate::grpc`) turns the result into a response.
//!
//! One file per phase: [`claim`] (the claim with phase `started`'s ride, `claim.sql`) and
//! [`ride_created`] (the charge and its record), with [`attempt`] an attempt's two steps (the
//! read that answers most replays in the request itself, then the attempt that may write),
//! [`params`] the request's validated parameters and [`error`] why an attempt ended without an
//! outcome. A new phase is a new
//! recovery point (a migration), a file here with its statement, and an arm in
//! [`Rides::step_with`].

mod attempt;
pub mod claim;
mod error;
mod params;
mod ride_created;

use std::{net::IpAddr, sync::Arc, time::Instant};

use chrono::{DateTime, Utc};
use contract::{
    Outcome, RideView,
    key::{LockRule, LockState, chrono_duration},
};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use provider::StripeClient;
use schema::{
    Pool, RecoveryPoint,
    liveness::Liveness,
    models::{Ride, User},
    schema::rides,
    store::{ConflictRetry, StoreError},
};
use telemetry::attr;
use tracing::Instrument;

pub use attempt::{Begun, RideAttempt};
pub use error::CreateRideError;
pub use params::{CREATE_RIDE_METHOD, CREATE_RIDE_PATH, FieldViolation, RideParams};
#[cfg(feature = "testing")]
pub(crate) use ride_created::charge_request;

pub use claim::{FirstRide, RideClaim};

use self::ride_created::RecordCharges;
use crate::{
    config::{IdempotencyConfig, Price},
    fault::CrashPoint,
    idempotency::{
        self, BatchCounts, Batcher, Claimed, Claims, Decision, IdempotencyKey, Lease, Waits,
    },
    metrics::metrics,
};

/// CreateRide's claims, batched.
pub type RideClaims = Batcher<Claims<RideClaim>>;

/// What a CreateRide call answered.
#[derive(Debug)]
pub struct CreateRideReply {
    /// When the key will be reaped; absent only if the key could not be read at all.
    pub key_expires_at: Option<DateTime<Utc>>,
    pub replayed: bool,
    pub result: Result<Outcome, CreateRideError>,
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
    /// Groups concurrent claims into shared statements.
    claims: Arc<RideClaims>,
    /// Groups concurrent requests' charge records into shared statements.
    charges: Batcher<RecordCharges>,
    stripe: StripeClient,
    price: Price,
    idempotency: IdempotencyConfig,
    /// The holder this process's locks name, and when another attempt's lock may be taken over.
    locking: idempotency::Locking,
    retry: ConflictRetry,
    /// The keys this process's attempts hold and the duplicates waiting for them.
    waits: Waits,
}

impl Rides {
    pub fn new(
        pool: Pool,
        stripe: StripeClient,
        price: Price,
        idempotency: IdempotencyConfig,
        liveness: Liveness,
    ) -> Arc<Rides> {
        let retry = ConflictRetry::default();
        // Every reason's series exists from the start, so that an alert on its rise has a base.
        for state in [LockState::HolderGone, LockState::Expired] {
            if let Some(reason) = state.takeover_reason() {
                metrics().takeovers.add(0, &[attr("reason", reason)]);
            }
        }
        Arc::new(Rides {
            locking: idempotency::Locking {
                liveness,
                rule: LockRule::new(idempotency.lock_timeout, stripe.idempotency_window()),
            },
            claims: Arc::new(Batcher::new(
                Claims::new(RideClaim),
                pool.clone(),
                retry,
                idempotency.claim_batching,
            )),
            charges: Batcher::new(
                RecordCharges,
                pool.clone(),
                retry,
                idempotency.phase_batching,
            ),
            pool,
            stripe,
            price,
            waits: Waits::new(idempotency.wait),
            idempotency,
            retry,
        })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    #[cfg(feature = "testing")]
    pub(crate) fn stripe(&self) -> &StripeClient {
        &self.stripe
    }

    /// The holder this process's locks name, and when another attempt's lock may be taken over.
    pub fn locking(&self) -> &idempotency::Locking {
        &self.locking
    }

    /// How long, and how many, duplicates may wait for the attempt in flight on their key.
    pub fn wait_config(&self) -> idempotency::WaitConfig {
        self.waits.config()
    }

    /// The claim batcher, whose counts tell how many claims shared statements.
    pub fn claim_batcher(&self) -> &Arc<RideClaims> {
        &self.claims
    }

    /// How many requests' write phases (the charge records) shared statements.
    pub fn phase_batch_counts(&self) -> BatchCounts {
        self.charges.counts()
    }

    /// The answer to a claim that failed. One that failed on a lost connection or an unreachable
    /// database may have committed all the same (the primary died after its synchronous standby
    /// had the commit), leaving the key locked by `unlock`'s token, which no other attempt
    /// knows: it is undone in the background, or every retry would be refused until the lock
    /// expired.
    fn claim_failed(
        &self,
        error: StoreError,
        unlock: idempotency::Unlock,
        expires: Instant,
    ) -> CreateRideReply {
        if matches!(
            error,
            StoreError::ConnectionLost(_) | StoreError::Unavailable(_)
        ) {
            self.unlock_in_background(unlock, expires);
        }
        Self::failed(error)
    }

    /// The answer to a call whose claim failed before it decided anything.
    fn failed(error: StoreError) -> CreateRideReply {
        CreateRideReply {
            key_expires_at: None,
            replayed: false,
            result: Err(error.into()),
        }
    }

    /// Acts on a claim: refuses (`waited`: a key in use after this call waited for it),
    /// replays, or runs the key to a final outcome.
    async fn answer(
        &self,
        claimed: Claimed<Ride>,
        key: &IdempotencyKey,
        request: &RideRequest,
        waited: bool,
    ) -> CreateRideReply {
        let key_expires_at = claimed
            .key_created_at
            .checked_add_signed(chrono_duration(self.idempotency.key_ttl));
        let (replayed, result) = match claimed.decision {
            Decision::Mismatch => (false, Err(CreateRideError::KeyReused)),
            Decision::InUse => {
                metrics().lock_conflicts.add(1, &[attr("kind", "in_use")]);
                (false, Err(CreateRideError::KeyInUse { waited }))
            }
            Decision::Replay(stored) => {
                metrics().replays.add(1, &[]);
                (
                    true,
                    Outcome::from_stored(&stored).map_err(|error| StoreError::from(error).into()),
                )
            }
            Decision::Execute(mut lease) => {
                crate::fault::crash_point(CrashPoint::ClaimAfterCommit);
                if claimed.first_phase.is_some() {
                    crate::fault::crash_point(CrashPoint::StartedAfterCommit);
                }
                // Duplicates waiting on this process hear how this attempt ends.
                let holding = self.waits.hold(lease.user_id, key);
                let result = self
                    .step_with(&mut lease, request, claimed.first_phase)
                    .await;
                // Unlocked after a fenced-off phase too: a fence also fails while this attempt
                // still holds the lock, when the key is not where this attempt left it (a commit
                // it saw was lost). Releasing a lease that was taken over changes nothing.
                if result.is_err() {
                    self.unlock(&lease).await;
                }
                if let Ok(outcome) = &result {
                    holding.finished(|| outcome.to_stored());
                }
                (false, result)
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

    /// Unlocks the key so that a retry resumes at once. An unlock that fails (the database is
    /// unreachable: the phase usually failed for the same reason) is retried in the background
    /// until it succeeds or the lock would have expired anyway; the answer does not wait for it.
    async fn unlock(&self, lease: &Lease) {
        // Taken before the first try: the lock was taken earlier still, so it expires by then.
        let expires = Instant::now() + self.idempotency.lock_timeout;
        let Err(error) = idempotency::release(&self.pool, self.retry, lease).await else {
            return;
        };
        tracing::warn!(%error, key_id = lease.key_id, "could not unlock key; retrying in the background");
        self.unlock_in_background(idempotency::Unlock::Lease(lease.clone()), expires);
    }

    /// [`idempotency::Unlock::retry_in_background`], counted.
    fn unlock_in_background(&self, unlock: idempotency::Unlock, expires: Instant) {
        let kind = unlock.kind();
        if unlock.retry_in_background(self.pool.clone(), self.retry, expires) {
            metrics().unlock_retries.add(1, &[attr("kind", kind)]);
        }
    }

    /// Runs the phase for `lease.recovery_point`, which finishes the key, as an attempt that
    /// resumes there does (it reads the ride back). Public so that tests can run a key's phase
    /// apart from its claim, as a retry after a crash would.
    pub async fn step(
        &self,
        lease: &mut Lease,
        request: &RideRequest,
    ) -> Result<Outcome, CreateRideError> {
        self.step_with(lease, request, None).await
    }

    /// [`Rides::step`] with the ride the key's claim inserted (or `None` to read it back). Public
    /// so that tests can run a phase without its read.
    pub async fn step_with(
        &self,
        lease: &mut Lease,
        request: &RideRequest,
        ride: Option<Ride>,
    ) -> Result<Outcome, CreateRideError> {
        let point = lease.recovery_point;
        let span = tracing::info_span!(
            "phase",
            otel.name = %format_args!("phase {point}"),
            { telemetry::semconv::attribute::DB_SYSTEM_NAME } = telemetry::semconv::DB_SYSTEM_POSTGRESQL,
            rides.recovery_point.from = %point,
            rides.recovery_point.to = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        let started = Instant::now();
        let result = self
            .ride_created(lease, request, ride)
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

    /// The one phase this server resumes a key at, `ride_created`'s, which finishes the key;
    /// `ride` is the ride the key's claim inserted, or `None` to read it back (an attempt that
    /// resumes a key an earlier attempt claimed). Reading it outside the phase's statement is
    /// safe: only the holder of the key's lock changes a ride, by the phase that records the
    /// charge, and a lease that lost the lock meanwhile is fenced off by that phase.
    async fn ride_created(
        &self,
        lease: &mut Lease,
        request: &RideRequest,
        ride: Option<Ride>,
    ) -> Result<Outcome, CreateRideError> {
        let point = lease.recovery_point;
        match point {
            RecoveryPoint::RideCreated => {}
            RecoveryPoint::Started | RecoveryPoint::ChargeCreated => {
                return Err(CreateRideError::LeftByOlderServer(point));
            }
            RecoveryPoint::Finished => {
                return Err(CreateRideError::Internal(
                    "a finished key cannot be run again".into(),
                ));
            }
        }
        let resumed = ride.is_none();
        let ride = match ride {
            Some(ride) => ride,
            None => self.ride_for_key(lease).await?,
        };
        let outcome = self.charge(lease, request, ride, resumed).await?;
        lease.recovery_point = RecoveryPoint::Finished;
        tracing::debug!(key_id = lease.key_id, from = %point, "phase committed");
        Ok(outcome)
    }

    async fn ride_for_key(&self, lease: &Lease) -> Result<Ride, CreateRideError> {
        let mut conn = self.pool.get().await.map_err(|error| {
            CreateRideError::DatabaseUnavailable(StoreError::Unavailable(error))
        })?;
        rides::table
            .filter(rides::idempotency_key_id.eq(lease.key_id))
            .filter(rides::user_id.eq(lease.user_id))
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
