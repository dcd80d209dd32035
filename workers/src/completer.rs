//! The completer: finds idempotency keys whose clients seem to have given up and pushes each
//! through the public CreateRide path over gRPC, as the key's user, with the key's own
//! idempotency key and parameters. It knows nothing of the phases: the api-server resumes from
//! the key's recovery point, so a key at `charge_created` is never charged again.
//!
//! A key is a candidate when it is unfinished, not given up on, due (`completer_next_attempt_at`),
//! and either locked by a holder that is gone (`contract::key::LockRule`: taken at once), or
//! unlocked (or its lock expired), older than `min_age` and not run for `idle`.
//! A batch is claimed atomically: `UPDATE … SET completer_next_attempt_at = now() + lease WHERE
//! id IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT n) RETURNING …`, so concurrent completers never
//! work the same key. Failed attempts back off exponentially per key; after `max_attempts` the
//! key is recorded in `keys_needing_attention` and left alone.

use std::time::Duration;

use chrono::{DateTime, Utc};
use contract::StoredRideRequest;
use diesel::{
    QueryableByName,
    sql_types::{BigInt, Double, Integer, Jsonb, Text, Timestamptz},
};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use proto::v1::CreateRideRequest;
use rides_client::{CallError, Created, Credential, RetryPolicy, RidesClient, RidesError};
use schema::{Pool, PoolError};
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tonic::Code;

use crate::{
    backoff,
    config::{CompleterConfig, ConfigError, Secret},
    metrics::{self, Handled},
    redact,
    worker_loop::{self, Next, Passes},
};

#[derive(Debug, thiserror::Error)]
pub enum CompleteError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("API_SERVER_URL and its TLS settings are not usable")]
    ApiUrl(#[source] proto::client::EndpointError),
    #[error("no database connection available")]
    Pool(#[from] PoolError),
    #[error("database error")]
    Database(#[from] diesel::result::Error),
    #[error("the api-server refused the internal credential ({0:?}); check INTERNAL_API_TOKEN")]
    Credential(Code),
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CompleteSummary {
    /// Keys claimed in this pass.
    pub claimed: u64,
    pub completed: u64,
    /// Finished with a final card decline.
    pub declined: u64,
    /// Still failing; retried later with back-off.
    pub still_failing: u64,
    /// Someone else held the key; not counted as an attempt.
    pub skipped_in_use: u64,
    /// Refused by a rate limit, or the api-server not reached: not the key's fault, so not
    /// counted as an attempt; tried again after the server's hint or the first back-off step.
    pub deferred: u64,
    /// Attempts exhausted; recorded in `keys_needing_attention`.
    pub gave_up: u64,
}

impl CompleteSummary {
    /// Counts this summary in the worker's metric, by outcome.
    pub(crate) fn record(&self) {
        metrics::count(Handled::Completer, "completed", self.completed);
        metrics::count(Handled::Completer, "declined", self.declined);
        metrics::count(Handled::Completer, "still_failing", self.still_failing);
        metrics::count(Handled::Completer, "deferred", self.deferred);
        metrics::count(Handled::Completer, "skipped_in_use", self.skipped_in_use);
        metrics::count(Handled::Completer, "gave_up", self.gave_up);
    }
}

/// A claimed key.
#[derive(Debug, QueryableByName)]
pub struct ClaimedKey {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = BigInt)]
    pub user_id: i64,
    #[diesel(sql_type = Text)]
    pub idempotency_key: String,
    #[diesel(sql_type = Jsonb)]
    pub request_params: serde_json::Value,
    #[diesel(sql_type = Text)]
    pub recovery_point: String,
    #[diesel(sql_type = Integer)]
    pub completer_attempts: i32,
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
}

/// A key whose lock's holder is gone (`contract::key::LockRule`) is taken at once, whatever its
/// age and idle time: its holder died mid-request and nobody else is bound to finish it.
const CLAIM_BATCH: &str = concat!(
    "
UPDATE idempotency_keys AS k
SET completer_next_attempt_at = now() + make_interval(secs => $1)
WHERE k.id IN (
    SELECT id FROM idempotency_keys
    WHERE recovery_point <> 'finished'
      AND completer_gave_up_at IS NULL
      AND (completer_next_attempt_at IS NULL OR completer_next_attempt_at <= now())
      AND CASE ",
    contract::lock_state_sql!("$4", "$6"),
    "
          WHEN 'holder_gone' THEN true
          WHEN 'live' THEN false
          ELSE created_at < now() - make_interval(secs => $2)
               AND last_run_at < now() - make_interval(secs => $3)
          END
    ORDER BY created_at, id
    LIMIT $5
    FOR UPDATE SKIP LOCKED
)
RETURNING k.id, k.user_id, k.idempotency_key, k.request_params, k.recovery_point,
          k.completer_attempts, k.created_at"
);

/// What the api-server said about one key.
#[derive(Debug, PartialEq, Eq)]
pub enum Attempt {
    Completed,
    Declined,
    InUse,
    /// Not the key's failure: a rate limit (with the server's retry hint, if any), a transport
    /// failure before the server answered, or a key that awaits the upgrade of an older server's
    /// keys. Never counted as an attempt, so a busy or unreachable
    /// api-server cannot make the completer give keys up (and their charges refundable).
    Deferred(Option<Duration>),
    StillFailing(String),
    /// The internal credential was refused: a configuration problem, not the key's.
    CredentialRefused(Code),
}

/// Classifies a CreateRide call by the client's typed error (its `ErrorInfo` reason).
pub fn classify(result: &Result<Created, CallError>) -> Attempt {
    let error = match result {
        Ok(_) => return Attempt::Completed,
        Err(call) => &call.error,
    };
    match error {
        // Both final and stored on the key: nothing left to complete.
        RidesError::CardDeclined { .. } | RidesError::PaymentRefunded(_) => Attempt::Declined,
        RidesError::IdempotencyKeyInUse(_) => Attempt::InUse,
        RidesError::MissingCredentials(status)
        | RidesError::InvalidCredentials(status)
        | RidesError::OnBehalfOfRequired(status)
        | RidesError::OnBehalfOfNotAllowed(status)
        | RidesError::InternalCredentialNotAllowed(status) => {
            Attempt::CredentialRefused(status.code())
        }
        RidesError::RateLimited { retry_after, .. } => Attempt::Deferred(*retry_after),
        // An older server left the key where this api-server does not resume it: the operator's
        // `workers admin keys upgrade` (or an older server's retry) takes it on, so giving it up
        // would only hand a person what the upgrade does.
        RidesError::IdempotencyKeyNeedsUpgrade(_) => Attempt::Deferred(None),
        // The server was not reached (connection refused or closed, a GOAWAY): nothing ran.
        // Other transport failures (a reset or a deadline mid-call) may have run the attempt.
        RidesError::Transport(status) if status.code() == Code::Unavailable => {
            Attempt::Deferred(None)
        }
        RidesError::InvalidIdempotencyKey(_)
        | RidesError::InvalidIdempotencyWait(_)
        | RidesError::InvalidRideParameters(_)
        | RidesError::IdempotencyKeyReused(_)
        | RidesError::IdempotencyKeyLockLost(_)
        | RidesError::ConcurrencyConflict(_)
        | RidesError::PaymentProviderUnavailable(_)
        | RidesError::DatabaseUnavailable(_)
        | RidesError::Internal(_)
        | RidesError::RideNotFound(_)
        | RidesError::UnknownReason { .. }
        | RidesError::Transport(_)
        | RidesError::ServerGoingAway(_)
        | RidesError::AttemptTimedOut(_)
        | RidesError::DeadlineExceeded { .. }
        | RidesError::MissingRide
        | RidesError::InvalidMetadata(_) => Attempt::StillFailing(match error.status() {
            Some(status) => format!("{}: {}", error.label(), status.message()),
            None => format!("{}: {error}", error.label()),
        }),
    }
}

pub struct Completer {
    pool: Pool,
    /// One attempt per key and pass ([`RetryPolicy::single_attempt`]): the completer retries
    /// across passes with its own per-key back-off, and a pass works its keys one after another,
    /// so in-call retries during a provider outage would hold every other key up.
    client: RidesClient,
    token: Secret,
    config: CompleterConfig,
}

impl Completer {
    pub fn new(pool: Pool, config: CompleterConfig) -> Result<Completer, CompleteError> {
        let token = config.token()?.clone();
        // Each key's call replaces the credential with one on behalf of the key's user.
        let client = RidesClient::connect_lazy(
            &config.api_server_url,
            &config.api_server_tls,
            Credential::User(token.clone()),
        )
        .map_err(CompleteError::ApiUrl)?
        .with_policy(RetryPolicy {
            // A key in use has a live attempt that will finish it; waiting for that attempt would
            // hold the pass's other keys up, as in-call retries would.
            idempotency_wait: Some(std::time::Duration::ZERO),
            ..RetryPolicy::single_attempt(config.rpc_timeout)
        });
        Ok(Completer {
            pool,
            client,
            token,
            config,
        })
    }

    /// One pass over one claimed batch.
    pub async fn run_once(&self) -> Result<CompleteSummary, CompleteError> {
        let mut conn = self.pool.get().await?;
        let mut keys: Vec<ClaimedKey> = diesel::sql_query(CLAIM_BATCH)
            .bind::<Double, _>(self.config.lease.as_secs_f64())
            .bind::<Double, _>(self.config.min_age.as_secs_f64())
            .bind::<Double, _>(self.config.idle.as_secs_f64())
            .bind::<Double, _>(self.config.lock_rule.secs().0)
            .bind::<BigInt, _>(self.config.batch_size)
            .bind::<Double, _>(self.config.lock_rule.secs().1)
            .load(&mut conn)
            .await?;
        drop(conn);
        keys.sort_by_key(|key| (key.created_at, key.id));
        let mut summary = CompleteSummary {
            claimed: keys.len() as u64,
            ..CompleteSummary::default()
        };
        for key in &keys {
            let attempt = self.attempt(key).await;
            tracing::info!(
                key_id = key.id,
                key = %redact::key(&key.idempotency_key),
                recovery_point = key.recovery_point,
                ?attempt,
                "completer attempt"
            );
            match attempt {
                Attempt::Completed => {
                    summary.completed += 1;
                    self.settle(key, Settle::Done).await?;
                }
                Attempt::Declined => {
                    summary.declined += 1;
                    self.settle(key, Settle::Done).await?;
                }
                Attempt::InUse => {
                    summary.skipped_in_use += 1;
                    self.settle(key, Settle::Release).await?;
                }
                Attempt::Deferred(hint) => {
                    summary.deferred += 1;
                    let delay = hint.unwrap_or(self.config.backoff_base);
                    self.settle(key, Settle::DeferFor(delay)).await?;
                }
                Attempt::StillFailing(error) => {
                    let attempts = key.completer_attempts.saturating_add(1);
                    if attempts >= self.config.max_attempts {
                        if self.give_up(key, &error).await? {
                            summary.gave_up += 1;
                        }
                    } else {
                        summary.still_failing += 1;
                        let delay = backoff::exponential(
                            self.config.backoff_base,
                            u32::try_from(attempts - 1).unwrap_or(0),
                            self.config.backoff_max,
                        );
                        self.settle(key, Settle::RetryIn(delay)).await?;
                    }
                }
                Attempt::CredentialRefused(code) => {
                    // Every key would fail the same way: stop the pass without spending any
                    // key's attempts. The remaining claims lapse with their lease.
                    self.settle(key, Settle::Release).await?;
                    return Err(CompleteError::Credential(code));
                }
            }
        }
        summary.record();
        if let Ok(mut conn) = self.pool.get().await {
            crate::metrics::observe_needing_attention(&mut conn).await;
        }
        Ok(summary)
    }

    pub async fn run(&self, shutdown_token: CancellationToken) -> CompleteSummary {
        let mut passes = CompleterPasses {
            completer: self,
            total: CompleteSummary::default(),
        };
        let failing = backoff::Backoff::new(self.config.interval, self.config.interval);
        worker_loop::run_passes(&mut passes, &shutdown_token, failing).await;
        passes.total
    }

    async fn attempt(&self, key: &ClaimedKey) -> Attempt {
        let body = match request_from_params(&key.request_params) {
            Some(body) => body,
            None => return Attempt::StillFailing("request_params are not a ride request".into()),
        };
        let credential = Credential::Internal {
            token: self.token.clone(),
            on_behalf_of: key.user_id,
        };
        let result = self
            .client
            .clone()
            .with_credential(credential)
            .create_ride_with_key(key.idempotency_key.as_str(), body)
            .await;
        classify(&result)
    }

    async fn settle(&self, key: &ClaimedKey, settle: Settle) -> Result<(), CompleteError> {
        let mut conn = self.pool.get().await?;
        // Each variant binds the same three parameters so that one statement shape serves all.
        let (sql, delay) = match settle {
            Settle::Done => (
                "UPDATE idempotency_keys SET completer_attempts = completer_attempts + 1, \
                 completer_next_attempt_at = NULL WHERE id = $1 AND user_id = $3 AND $2 >= 0",
                Duration::ZERO,
            ),
            Settle::Release => (
                "UPDATE idempotency_keys SET completer_next_attempt_at = NULL \
                 WHERE id = $1 AND user_id = $3 AND $2 >= 0",
                Duration::ZERO,
            ),
            Settle::DeferFor(delay) => (
                "UPDATE idempotency_keys \
                 SET completer_next_attempt_at = now() + make_interval(secs => $2) \
                 WHERE id = $1 AND user_id = $3",
                delay,
            ),
            Settle::RetryIn(delay) => (
                "UPDATE idempotency_keys SET completer_attempts = completer_attempts + 1, \
                 completer_next_attempt_at = now() + make_interval(secs => $2) \
                 WHERE id = $1 AND user_id = $3",
                delay,
            ),
        };
        diesel::sql_query(sql)
            .bind::<BigInt, _>(key.id)
            .bind::<Double, _>(delay.as_secs_f64())
            .bind::<BigInt, _>(key.user_id)
            .execute(&mut conn)
            .await?;
        Ok(())
    }

    /// Marks the key as given up and records it for a human, in one transaction. False if the
    /// key finished or vanished meanwhile (nothing to hand over).
    async fn give_up(&self, key: &ClaimedKey, error: &str) -> Result<bool, CompleteError> {
        let mut conn = self.pool.get().await?;
        let error: String = error.chars().take(2000).collect();
        let given_up = conn
            .transaction(async |conn| give_up_in(conn, key, &error).await)
            .await?;
        if given_up {
            tracing::error!(
                key_id = key.id,
                "completer gave up on a key; recorded for a human"
            );
        }
        Ok(given_up)
    }
}

enum Settle {
    /// The key is finished: count the attempt, drop the lease.
    Done,
    /// Not our turn: drop the lease without counting an attempt.
    Release,
    /// Try again after the delay without counting an attempt.
    DeferFor(Duration),
    /// Count the attempt and try again after the delay.
    RetryIn(Duration),
}

async fn give_up_in(
    conn: &mut AsyncPgConnection,
    key: &ClaimedKey,
    error: &str,
) -> Result<bool, diesel::result::Error> {
    let updated = diesel::sql_query(
        "UPDATE idempotency_keys SET completer_attempts = completer_attempts + 1, \
         completer_gave_up_at = now(), completer_next_attempt_at = NULL \
         WHERE id = $1 AND user_id = $2 AND recovery_point <> 'finished' \
         AND completer_gave_up_at IS NULL",
    )
    .bind::<BigInt, _>(key.id)
    .bind::<BigInt, _>(key.user_id)
    .execute(conn)
    .await?;
    if updated == 0 {
        return Ok(false);
    }
    diesel::sql_query(
        "INSERT INTO keys_needing_attention (reason, idempotency_key_id, user_id, \
         idempotency_key, recovery_point, request_params, last_error) \
         SELECT 'completer_gave_up', id, user_id, idempotency_key, recovery_point, \
         request_params, $3 FROM idempotency_keys WHERE id = $1 AND user_id = $2",
    )
    .bind::<BigInt, _>(key.id)
    .bind::<BigInt, _>(key.user_id)
    .bind::<Text, _>(error)
    .execute(conn)
    .await?;
    Ok(true)
}

/// Rebuilds the request from the stored `request_params` (`contract::StoredRideRequest`);
/// `None` if they are not a stored ride request.
pub fn request_from_params(params: &serde_json::Value) -> Option<CreateRideRequest> {
    let stored = StoredRideRequest::from_stored(params)?;
    Some(CreateRideRequest {
        origin_lat: Some(stored.origin_lat),
        origin_lon: Some(stored.origin_lon),
        target_lat: Some(stored.target_lat),
        target_lon: Some(stored.target_lon),
    })
}

/// The completer's loop state: a pass, then again at once after a full batch (more are likely
/// due), else after the interval.
struct CompleterPasses<'a> {
    completer: &'a Completer,
    total: CompleteSummary,
}

impl Passes for CompleterPasses<'_> {
    type Error = CompleteError;
    const WORKER: &'static str = "completer";

    async fn pass(&mut self) -> Result<Next, CompleteError> {
        let summary = self.completer.run_once().await?;
        let total = &mut self.total;
        total.claimed += summary.claimed;
        total.completed += summary.completed;
        total.declined += summary.declined;
        total.still_failing += summary.still_failing;
        total.skipped_in_use += summary.skipped_in_use;
        total.deferred += summary.deferred;
        total.gave_up += summary.gave_up;
        let config = &self.completer.config;
        if summary.claimed > 0 {
            tracing::info!(?summary, "completer pass");
            if summary.claimed >= u64::try_from(config.batch_size).unwrap_or(0) {
                return Ok(Next::Now);
            }
        }
        Ok(Next::After(config.interval))
    }
}

#[cfg(test)]
mod tests;
