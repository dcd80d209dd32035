//! Typed errors: one [`RidesError`] variant per `ErrorInfo` reason of the table in docs/errors.md, plus
//! what happens below the API (a transport failure, an attempt that timed out, the call's
//! deadline) and what a caller can get wrong before anything is sent. [`RidesError::is_retryable`]
//! is the table's "retry?" column. A whole call's failure is a [`CallError`]: the last error with
//! the key used and every attempt made.

use std::time::Duration;

use proto::reason;
use tonic::{Code, Status};
use tonic_types::StatusExt;

use crate::attempt::AttemptRecord;

/// Why one attempt, or a whole call, did not succeed. Every variant built from a server's answer
/// keeps the [`Status`] as its source (message, details, metadata).
#[derive(Debug, thiserror::Error)]
pub enum RidesError {
    #[error("no credentials were sent (MISSING_CREDENTIALS)")]
    MissingCredentials(#[source] Box<Status>),
    #[error("the credential is not valid (INVALID_CREDENTIALS)")]
    InvalidCredentials(#[source] Box<Status>),
    #[error("the internal credential needs on-behalf-of-user (ON_BEHALF_OF_REQUIRED)")]
    OnBehalfOfRequired(#[source] Box<Status>),
    #[error("only the internal credential may act on behalf of a user (ON_BEHALF_OF_NOT_ALLOWED)")]
    OnBehalfOfNotAllowed(#[source] Box<Status>),
    /// The internal credential called GetRide, or CreateRide with a key its user never created.
    #[error(
        "the internal credential may only resume an existing key with CreateRide \
         (INTERNAL_CREDENTIAL_NOT_ALLOWED)"
    )]
    InternalCredentialNotAllowed(#[source] Box<Status>),
    /// A per-user limit; nothing was written. Retryable after `retry_after`.
    #[error("rate limited (RATE_LIMITED)")]
    RateLimited {
        retry_after: Option<Duration>,
        #[source]
        status: Box<Status>,
    },
    #[error("the idempotency key is not valid (INVALID_IDEMPOTENCY_KEY)")]
    InvalidIdempotencyKey(#[source] Box<Status>),
    #[error("the idempotency-wait metadata is not valid (INVALID_IDEMPOTENCY_WAIT)")]
    InvalidIdempotencyWait(#[source] Box<Status>),
    #[error("the ride parameters are not valid (INVALID_RIDE_PARAMETERS)")]
    InvalidRideParameters(#[source] Box<Status>),
    /// The key was used with other parameters: a new logical request needs a new key.
    #[error("the idempotency key was used with different parameters (IDEMPOTENCY_KEY_REUSED)")]
    IdempotencyKeyReused(#[source] Box<Status>),
    /// Final, stored on the key and replayed: the card was declined.
    #[error("the card was declined (CARD_DECLINED, decline code {decline_code:?})")]
    CardDeclined {
        decline_code: Option<String>,
        #[source]
        status: Box<Status>,
    },
    /// Final, stored on the key and replayed: the key's charge was refunded.
    #[error("the payment was refunded (PAYMENT_REFUNDED)")]
    PaymentRefunded(#[source] Box<Status>),
    #[error("another attempt holds the key (IDEMPOTENCY_KEY_IN_USE)")]
    IdempotencyKeyInUse(#[source] Box<Status>),
    #[error("this attempt's lock on the key was taken over (IDEMPOTENCY_KEY_LOCK_LOST)")]
    IdempotencyKeyLockLost(#[source] Box<Status>),
    #[error("database conflicts persisted (CONCURRENCY_CONFLICT)")]
    ConcurrencyConflict(#[source] Box<Status>),
    #[error("the payment provider is unavailable (PAYMENT_PROVIDER_UNAVAILABLE)")]
    PaymentProviderUnavailable(#[source] Box<Status>),
    #[error("the database is unavailable (DATABASE_UNAVAILABLE)")]
    DatabaseUnavailable(#[source] Box<Status>),
    /// The key is where a server older than this one left it; retried, an older server or the
    /// operator's `workers admin keys upgrade` takes it on.
    #[error("the key awaits the upgrade of an older server's keys (IDEMPOTENCY_KEY_NEEDS_UPGRADE)")]
    IdempotencyKeyNeedsUpgrade(#[source] Box<Status>),
    #[error("the server failed unexpectedly (INTERNAL)")]
    Internal(#[source] Box<Status>),
    #[error("no such ride of this caller (RIDE_NOT_FOUND)")]
    RideNotFound(#[source] Box<Status>),
    /// An answer with no `ErrorInfo` of our domain but from a server (e.g. `OUT_OF_RANGE` for an
    /// oversized message), or a reason this client does not know (a newer server).
    #[error("{:?} with a reason this client does not know ({reason:?})", .status.code())]
    UnknownReason {
        reason: Option<String>,
        #[source]
        status: Box<Status>,
    },
    /// The connection failed or was reset, or a proxy answered: the request may or may not have
    /// reached the server. Retryable with the same key, which is the point of the key.
    #[error("transport failure ({:?})", .0.code())]
    Transport(#[source] Box<Status>),
    /// The server had announced that it was closing the connection (an HTTP/2 GOAWAY with
    /// NO_ERROR: a graceful shutdown, a drain, a proxy recycling connections), and this request
    /// was refused on this side for it or cut when the connection then closed; it may or may not
    /// have reached the server. tonic reports it as `INTERNAL` (`h2 protocol error`), which is no
    /// answer of the server: it is counted as `CLIENT/GOAWAY` with the code `UNAVAILABLE`, as
    /// grpc-java does, and retried with the same key like any transport failure.
    #[error("the server was closing the connection (HTTP/2 GOAWAY)")]
    ServerGoingAway(#[source] Box<Status>),
    /// This attempt got no answer within its timeout; the server may still be running it.
    #[error("no answer within {0:?}")]
    AttemptTimedOut(Duration),
    /// The call's overall deadline passed, or the next wait would have passed it. `last` is the
    /// last attempt's error.
    #[error("the call's deadline of {deadline:?} passed")]
    DeadlineExceeded {
        deadline: Duration,
        #[source]
        last: Option<Box<RidesError>>,
    },
    /// The server answered OK without the ride a CreateRide answer always has.
    #[error("the answer has no ride")]
    MissingRide,
    /// Nothing was sent: the token or the key cannot be a header value (visible ASCII only).
    #[error("the {0} cannot be sent as metadata (visible ASCII only)")]
    InvalidMetadata(&'static str),
}

impl RidesError {
    /// Whether trying again with the same key may succeed: docs/errors.md's "retry?" column, and for
    /// what the table does not cover, whether the request may have gone unanswered (transport,
    /// timeouts) or the server said so by its code (`UNAVAILABLE`, `ABORTED`, as the service
    /// config for other languages retries). After [`RidesError::DeadlineExceeded`] the call is
    /// over but the key is resumable by a later call.
    pub fn is_retryable(&self) -> bool {
        match self {
            RidesError::MissingCredentials(_)
            | RidesError::InvalidCredentials(_)
            | RidesError::OnBehalfOfRequired(_)
            | RidesError::OnBehalfOfNotAllowed(_)
            | RidesError::InternalCredentialNotAllowed(_)
            | RidesError::InvalidIdempotencyKey(_)
            | RidesError::InvalidIdempotencyWait(_)
            | RidesError::InvalidRideParameters(_)
            | RidesError::IdempotencyKeyReused(_)
            | RidesError::CardDeclined { .. }
            | RidesError::PaymentRefunded(_)
            | RidesError::RideNotFound(_)
            | RidesError::MissingRide
            | RidesError::InvalidMetadata(_) => false,
            RidesError::RateLimited { .. }
            | RidesError::IdempotencyKeyInUse(_)
            | RidesError::IdempotencyKeyLockLost(_)
            | RidesError::ConcurrencyConflict(_)
            | RidesError::PaymentProviderUnavailable(_)
            | RidesError::DatabaseUnavailable(_)
            | RidesError::IdempotencyKeyNeedsUpgrade(_)
            | RidesError::Internal(_)
            | RidesError::Transport(_)
            | RidesError::ServerGoingAway(_)
            | RidesError::AttemptTimedOut(_)
            | RidesError::DeadlineExceeded { .. } => true,
            RidesError::UnknownReason { status, .. } => {
                matches!(status.code(), Code::Unavailable | Code::Aborted)
            }
        }
    }

    /// The server's answer, for the variants that have one.
    pub fn status(&self) -> Option<&Status> {
        self.origin().ok()
    }

    /// The gRPC code this error means for a span's `rpc.response.status_code`: the server's, or
    /// `DEADLINE_EXCEEDED` for a timeout on this side (as a gRPC client reports one).
    pub fn code(&self) -> Option<Code> {
        match self.origin() {
            Ok(status) => Some(status.code()),
            Err(local) => local.code,
        }
    }

    /// The server's answer, or what happened on this side.
    fn origin(&self) -> Result<&Status, Local> {
        match self {
            RidesError::MissingCredentials(status)
            | RidesError::InvalidCredentials(status)
            | RidesError::OnBehalfOfRequired(status)
            | RidesError::OnBehalfOfNotAllowed(status)
            | RidesError::InternalCredentialNotAllowed(status)
            | RidesError::RateLimited { status, .. }
            | RidesError::InvalidIdempotencyKey(status)
            | RidesError::InvalidIdempotencyWait(status)
            | RidesError::InvalidRideParameters(status)
            | RidesError::IdempotencyKeyReused(status)
            | RidesError::CardDeclined { status, .. }
            | RidesError::PaymentRefunded(status)
            | RidesError::IdempotencyKeyInUse(status)
            | RidesError::IdempotencyKeyLockLost(status)
            | RidesError::ConcurrencyConflict(status)
            | RidesError::PaymentProviderUnavailable(status)
            | RidesError::DatabaseUnavailable(status)
            | RidesError::IdempotencyKeyNeedsUpgrade(status)
            | RidesError::Internal(status)
            | RidesError::RideNotFound(status)
            | RidesError::UnknownReason { status, .. }
            | RidesError::Transport(status) => Ok(status),
            RidesError::ServerGoingAway(_) => Err(Local {
                label: "GOAWAY",
                code: Some(Code::Unavailable),
            }),
            RidesError::AttemptTimedOut(_) => Err(Local::timeout("TIMEOUT")),
            RidesError::DeadlineExceeded { .. } => Err(Local::timeout("DEADLINE_EXCEEDED")),
            RidesError::MissingRide => Err(Local::other("MISSING_RIDE")),
            RidesError::InvalidMetadata(_) => Err(Local::other("BAD_METADATA")),
        }
    }

    /// The server's `RetryInfo` delay: the least a retry must wait.
    pub fn retry_after(&self) -> Option<Duration> {
        self.status()?.get_error_details().retry_info()?.retry_delay
    }

    /// `Code/REASON` as the campaign and the load generator count answers (`Unavailable/-` for
    /// a status without a reason, `CLIENT/…` for what happened on this side).
    pub fn label(&self) -> String {
        match self.origin() {
            Ok(status) => format!(
                "{:?}/{}",
                status.code(),
                our_error_info(status).map_or_else(|| "-".to_owned(), |info| info.reason)
            ),
            Err(local) => format!("CLIENT/{}", local.label),
        }
    }
}

/// An error of this side: its label and the gRPC code it amounts to.
struct Local {
    label: &'static str,
    code: Option<Code>,
}

impl Local {
    fn timeout(label: &'static str) -> Local {
        Local {
            label,
            code: Some(Code::DeadlineExceeded),
        }
    }

    fn other(label: &'static str) -> Local {
        Local { label, code: None }
    }
}

fn our_error_info(status: &Status) -> Option<tonic_types::ErrorInfo> {
    status
        .get_error_details()
        .error_info()
        .filter(|info| info.domain == reason::ERROR_DOMAIN)
        .cloned()
}

/// Whether the status is tonic's report of an HTTP/2 GOAWAY with NO_ERROR from the server (its
/// source chain holds the h2 error; no server sends such a status itself).
fn server_going_away(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR);
        }
        source = error.source();
    }
    false
}

impl From<Status> for RidesError {
    /// Classifies an answer by its `ErrorInfo` reason; without one, by whether the status came
    /// from below the API (transport codes) or from a server that said something we do not know.
    fn from(status: Status) -> RidesError {
        let Some(info) = our_error_info(&status) else {
            if server_going_away(&status) {
                return RidesError::ServerGoingAway(Box::new(status));
            }
            return match status.code() {
                Code::Unavailable
                | Code::Unknown
                | Code::Cancelled
                | Code::Internal
                | Code::DeadlineExceeded => RidesError::Transport(Box::new(status)),
                _ => RidesError::UnknownReason {
                    reason: None,
                    status: Box::new(status),
                },
            };
        };
        let status = Box::new(status);
        match info.reason.as_str() {
            reason::MISSING_CREDENTIALS => RidesError::MissingCredentials(status),
            reason::INVALID_CREDENTIALS => RidesError::InvalidCredentials(status),
            reason::ON_BEHALF_OF_REQUIRED => RidesError::OnBehalfOfRequired(status),
            reason::ON_BEHALF_OF_NOT_ALLOWED => RidesError::OnBehalfOfNotAllowed(status),
            reason::INTERNAL_CREDENTIAL_NOT_ALLOWED => {
                RidesError::InternalCredentialNotAllowed(status)
            }
            reason::RATE_LIMITED => RidesError::RateLimited {
                retry_after: status
                    .get_error_details()
                    .retry_info()
                    .and_then(|r| r.retry_delay),
                status,
            },
            reason::INVALID_IDEMPOTENCY_KEY => RidesError::InvalidIdempotencyKey(status),
            reason::INVALID_IDEMPOTENCY_WAIT => RidesError::InvalidIdempotencyWait(status),
            reason::INVALID_RIDE_PARAMETERS => RidesError::InvalidRideParameters(status),
            reason::IDEMPOTENCY_KEY_REUSED => RidesError::IdempotencyKeyReused(status),
            reason::CARD_DECLINED => RidesError::CardDeclined {
                decline_code: info.metadata.get(reason::DECLINE_CODE).cloned(),
                status,
            },
            reason::PAYMENT_REFUNDED => RidesError::PaymentRefunded(status),
            reason::IDEMPOTENCY_KEY_IN_USE => RidesError::IdempotencyKeyInUse(status),
            reason::IDEMPOTENCY_KEY_LOCK_LOST => RidesError::IdempotencyKeyLockLost(status),
            reason::CONCURRENCY_CONFLICT => RidesError::ConcurrencyConflict(status),
            reason::PAYMENT_PROVIDER_UNAVAILABLE => RidesError::PaymentProviderUnavailable(status),
            reason::DATABASE_UNAVAILABLE => RidesError::DatabaseUnavailable(status),
            reason::IDEMPOTENCY_KEY_NEEDS_UPGRADE => RidesError::IdempotencyKeyNeedsUpgrade(status),
            reason::INTERNAL => RidesError::Internal(status),
            reason::RIDE_NOT_FOUND => RidesError::RideNotFound(status),
            other => RidesError::UnknownReason {
                reason: Some(other.to_owned()),
                status,
            },
        }
    }
}

/// A call that ended without success: its last error, the key it used (CreateRide) and every
/// attempt it made, with what each answered and how long the client waited after it.
#[derive(Debug, thiserror::Error)]
#[error("{method} failed after {} attempt(s)", .log.len())]
pub struct CallError {
    /// `CreateRide` or `GetRide`.
    pub method: &'static str,
    /// The idempotency key every attempt sent (CreateRide only).
    pub key: Option<String>,
    pub log: Vec<AttemptRecord>,
    #[source]
    pub error: RidesError,
}

impl CallError {
    /// Attempts sent (zero when the request could not be built).
    pub fn attempts(&self) -> u32 {
        u32::try_from(self.log.len()).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests;
