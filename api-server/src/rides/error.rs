//! Why a CreateRide attempt ended without a final outcome; `crate::grpc::status` maps each to
//! its `Status` exhaustively.

use provider::ChargeError;
use schema::{RecoveryPoint, store::StoreError};

/// Why a CreateRide attempt ended without a final outcome.
#[derive(Debug, thiserror::Error)]
pub enum CreateRideError {
    #[error("the idempotency key was used with different parameters")]
    KeyReused,
    /// `waited`: this call waited for that request until its own wait was over (so a retry may
    /// come at once and wait again).
    #[error("another request with this idempotency key is in progress")]
    KeyInUse { waited: bool },
    #[error("another attempt took over this idempotency key")]
    LockLost,
    #[error("the request kept conflicting with concurrent requests")]
    Contended(#[source] StoreError),
    #[error("the database is unavailable")]
    DatabaseUnavailable(#[source] StoreError),
    /// This process's liveness session was not confirmed before the charge, or was lost before
    /// its result was recorded: the key may be another attempt's by now, so this one stopped.
    #[error("this server's liveness session in the database was lost")]
    LivenessLost,
    #[error("the payment provider is unavailable")]
    ProviderUnavailable(#[source] ChargeError),
    /// The key is at a recovery point only an older server, which committed phases `started`
    /// and `charge_created` on their own, stops at; this server has no phase for it.
    #[error("the key was left at {0} by an older server")]
    LeftByOlderServer(RecoveryPoint),
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
