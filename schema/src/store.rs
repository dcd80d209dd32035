//! What every statement can fail with, and the one policy for re-running a transaction that hit
//! a serialization failure or deadlock. Every crate that talks to PostgreSQL through the pool
//! (the api-server's phases and claims, its auth and reads) reports through [`StoreError`], so a
//! lost connection is "unavailable, retry" and never an internal error, whichever code hit it.
//! A few variants name failures of the `idempotency_keys` protocol (a fenced statement that lost
//! its lock, a key that vanished mid-claim, an unreadable stored outcome): the rows are this
//! crate's, and the api-server maps each variant to its status in one place.

use std::{future::Future, sync::OnceLock, time::Duration};

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel_async::AsyncPgConnection;
use opentelemetry::metrics::Counter;
use rand::Rng;

use crate::PoolError;

/// `rides.db.serialization_retries`: transactions re-run by [`retry_transient`].
fn serialization_retries() -> &'static Counter<u64> {
    static COUNTER: OnceLock<Counter<u64>> = OnceLock::new();
    COUNTER.get_or_init(|| {
        telemetry::meter("rides-db")
            .u64_counter("rides.db.serialization_retries")
            .with_description("Transactions re-run after a serialization failure or deadlock")
            .build()
    })
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("this attempt no longer holds the idempotency key's lock")]
    LockLost,
    #[error("gave up after {attempts} attempts that hit serialization failures or deadlocks")]
    Contended {
        attempts: u32,
        #[source]
        source: DieselError,
    },
    #[error("no database connection became available")]
    Unavailable(#[source] PoolError),
    #[error("the stored outcome of a finished key is unreadable")]
    CorruptStoredResponse,
    #[error("the idempotency key kept disappearing while it was being claimed")]
    KeyVanished,
    /// The server went away mid-conversation (restart, failover, network): worth a retry, like
    /// an empty pool, and not an internal error.
    #[error("the database connection was lost")]
    ConnectionLost(#[source] DieselError),
    #[error("database error")]
    Database(#[source] DieselError),
}

impl From<DieselError> for StoreError {
    fn from(error: DieselError) -> StoreError {
        if is_connection_loss(&error) {
            StoreError::ConnectionLost(error)
        } else {
            StoreError::Database(error)
        }
    }
}

/// True when the error says the connection, not the statement, failed: a closed connection,
/// SQLSTATE class 08 (connection exception) or 57P01..57P03 (the server is shutting down or
/// starting up). Every FATAL that starts "terminating connection" ends the session: an
/// administrator's command, the crash of another backend, and the postmaster's death, which is
/// what a primary's backends say when its postmaster is SIGKILLed in a failover (unrecognised, it
/// would answer the attempts in flight `INTERNAL` instead of retrying them on the new primary).
pub fn is_connection_loss(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(DatabaseErrorKind::ClosedConnection, _)
        | DieselError::BrokenTransactionManager => true,
        DieselError::DatabaseError(_, info) => {
            let message = info.message();
            message.starts_with("terminating connection")
                || message.starts_with("the database system is shutting down")
                || message.starts_with("the database system is starting up")
                || message.starts_with("connection closed")
                || message.contains("server closed the connection unexpectedly")
        }
        _ => false,
    }
}

/// `error` as a [`StoreError`]; if it says the connection was lost, `conn` is also marked so that
/// the pool discards it rather than handing it to the next request, which a retry right after
/// the loss would otherwise likely get back.
pub fn lost_connection_discarded(conn: &mut AsyncPgConnection, error: DieselError) -> StoreError {
    let error = StoreError::from(error);
    if matches!(error, StoreError::ConnectionLost(_)) {
        crate::pool::discard_on_return(conn);
    }
    error
}

/// How often and how patiently a transaction that hit a serialization failure or deadlock is
/// run again.
#[derive(Clone, Copy, Debug)]
pub struct ConflictRetry {
    pub max_attempts: u32,
    pub base_delay: Duration,
}

impl Default for ConflictRetry {
    fn default() -> Self {
        ConflictRetry {
            max_attempts: 6,
            base_delay: Duration::from_millis(5),
        }
    }
}

/// True for errors that say "run the whole transaction again": SQLSTATE 40001 and 40P01.
pub fn is_transient(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        // diesel has no kind for 40P01; its message is fixed by PostgreSQL.
        DieselError::DatabaseError(_, info) => info.message().starts_with("deadlock detected"),
        _ => false,
    }
}

/// Runs `run` (one whole transaction) until it succeeds, fails for a reason other than a
/// serialization failure or deadlock, or `policy` is exhausted. Backoff is exponential with full
/// jitter so that the transactions that collided do not collide again.
pub async fn retry_transient<T, F, Fut>(policy: ConflictRetry, mut run: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut attempt = 1;
    loop {
        match run().await {
            Err(StoreError::Database(error)) if is_transient(&error) => {
                if attempt >= policy.max_attempts {
                    return Err(StoreError::Contended {
                        attempts: attempt,
                        source: error,
                    });
                }
                let ceiling = policy.base_delay.saturating_mul(1 << attempt.min(10));
                let delay = rand::rng().random_range(Duration::ZERO..=ceiling);
                tracing::debug!(attempt, ?delay, "retrying a transaction after a conflict");
                serialization_retries().add(1, &[]);
                tokio::time::sleep(delay).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn database_error(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn a_lost_connection_is_unavailability_not_an_internal_error() {
        for lost in [
            database_error(DatabaseErrorKind::ClosedConnection, "connection closed"),
            database_error(
                DatabaseErrorKind::Unknown,
                "terminating connection due to administrator command",
            ),
            database_error(
                DatabaseErrorKind::Unknown,
                "terminating connection due to unexpected postmaster exit",
            ),
            database_error(
                DatabaseErrorKind::Unknown,
                "terminating connection because of crash of another server process",
            ),
            database_error(
                DatabaseErrorKind::Unknown,
                "the database system is shutting down",
            ),
        ] {
            assert!(matches!(
                StoreError::from(lost),
                StoreError::ConnectionLost(_)
            ));
        }
        let constraint = database_error(DatabaseErrorKind::UniqueViolation, "duplicate key");
        assert!(matches!(
            StoreError::from(constraint),
            StoreError::Database(_)
        ));
    }

    #[test]
    fn recognises_serialization_failures_and_deadlocks_only() {
        assert!(is_transient(&database_error(
            DatabaseErrorKind::SerializationFailure,
            "could not serialize access"
        )));
        assert!(is_transient(&database_error(
            DatabaseErrorKind::Unknown,
            "deadlock detected"
        )));
        assert!(!is_transient(&database_error(
            DatabaseErrorKind::UniqueViolation,
            "duplicate key"
        )));
        assert!(!is_transient(&DieselError::NotFound));
    }

    #[tokio::test]
    async fn gives_up_after_the_bounded_number_of_attempts() {
        let attempts = AtomicU32::new(0);
        let policy = ConflictRetry {
            max_attempts: 3,
            base_delay: Duration::from_millis(1),
        };
        let result: Result<(), _> = retry_transient(policy, || async {
            attempts.fetch_add(1, Ordering::SeqCst);
            Err(StoreError::Database(database_error(
                DatabaseErrorKind::SerializationFailure,
                "could not serialize access",
            )))
        })
        .await;
        assert!(matches!(
            result,
            Err(StoreError::Contended { attempts: 3, .. })
        ));
        assert_eq!(AtomicU32::load(&attempts, Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn does_not_retry_other_errors() {
        let attempts = AtomicU32::new(0);
        let result: Result<(), _> = retry_transient(ConflictRetry::default(), || async {
            attempts.fetch_add(1, Ordering::SeqCst);
            Err(StoreError::LockLost)
        })
        .await;
        assert!(matches!(result, Err(StoreError::LockLost)));
        assert_eq!(AtomicU32::load(&attempts, Ordering::SeqCst), 1);
    }
}
