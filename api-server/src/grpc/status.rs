//! Every error this API returns, with its `google.rpc.ErrorInfo` reason. Clients branch on the
//! reason, so the reasons are part of the contract (listed in docs/errors.md).

use std::{collections::HashMap, time::Duration};

use telemetry::error_chain;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use schema::store::StoreError;

use crate::rides::{CreateRideError, FieldViolation};

/// The reasons and their domain are the wire contract, defined once in `proto` for the server and
/// its clients alike.
pub use proto::reason::{self, ERROR_DOMAIN};

const RETRY_SOON: Duration = Duration::from_secs(1);
const RETRY_PROVIDER: Duration = Duration::from_secs(2);

fn error_info(reason: &str, metadata: HashMap<String, String>) -> ErrorDetails {
    ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata)
}

fn simple(code: Code, message: &str, reason: &str) -> Status {
    Status::with_error_details(code, message, error_info(reason, HashMap::new()))
}

fn retryable(code: Code, message: &str, reason: &str, after: Duration) -> Status {
    let mut details = error_info(reason, HashMap::new());
    details.set_retry_info(Some(after));
    Status::with_error_details(code, message, details)
}

pub fn missing_credentials() -> Status {
    simple(
        Code::Unauthenticated,
        "authorization metadata with a Bearer token is required",
        reason::MISSING_CREDENTIALS,
    )
}

pub fn invalid_credentials() -> Status {
    simple(
        Code::Unauthenticated,
        "the Bearer token is not valid",
        reason::INVALID_CREDENTIALS,
    )
}

/// A failed authentication that was counted against its peer where it was found
/// (`Admission::verify`, which counts even when the caller has gone); the answer must not count
/// it again.
#[derive(Debug, thiserror::Error)]
#[error("counted against the peer already")]
struct CountedAgainstPeer;

pub fn counted_against_peer(mut status: Status) -> Status {
    status.set_source(std::sync::Arc::new(CountedAgainstPeer));
    status
}

pub fn is_counted_against_peer(status: &Status) -> bool {
    std::error::Error::source(status).is_some_and(|source| source.is::<CountedAgainstPeer>())
}

pub fn on_behalf_of_not_allowed() -> Status {
    simple(
        Code::PermissionDenied,
        "only the internal credential may act on behalf of a user",
        reason::ON_BEHALF_OF_NOT_ALLOWED,
    )
}

pub fn on_behalf_of_required() -> Status {
    simple(
        Code::Unauthenticated,
        "the internal credential requires on-behalf-of-user metadata with a user id",
        reason::ON_BEHALF_OF_REQUIRED,
    )
}

pub fn internal_credential_new_key() -> Status {
    simple(
        Code::PermissionDenied,
        "the internal credential may only resume an idempotency key its user created",
        reason::INTERNAL_CREDENTIAL_NOT_ALLOWED,
    )
}

pub fn internal_credential_not_allowed() -> Status {
    simple(
        Code::PermissionDenied,
        "the internal credential may only call CreateRide",
        reason::INTERNAL_CREDENTIAL_NOT_ALLOWED,
    )
}

/// A per-user limit refused the call (`crate::limits`); `after` is when to try again.
pub fn rate_limited(message: &str, after: Duration) -> Status {
    retryable(
        Code::ResourceExhausted,
        message,
        reason::RATE_LIMITED,
        after,
    )
}

pub fn invalid_key(description: &str) -> Status {
    invalid_metadata(
        reason::INVALID_IDEMPOTENCY_KEY,
        "idempotency-key",
        description,
    )
}

pub fn invalid_wait(description: &str) -> Status {
    invalid_metadata(
        reason::INVALID_IDEMPOTENCY_WAIT,
        "idempotency-wait",
        description,
    )
}

/// A request metadata value that is not valid, named in a `BadRequest` violation.
fn invalid_metadata(reason: &str, name: &str, description: &str) -> Status {
    let mut details = error_info(reason, HashMap::new());
    details.add_bad_request_violation(name, description);
    Status::with_error_details(
        Code::InvalidArgument,
        format!("invalid {name} metadata: {description}"),
        details,
    )
}

pub fn invalid_params(violations: &[FieldViolation]) -> Status {
    let mut details = error_info(reason::INVALID_RIDE_PARAMETERS, HashMap::new());
    for violation in violations {
        details.add_bad_request_violation(violation.field, &violation.description);
    }
    let summary = violations
        .iter()
        .map(|violation| violation.description.as_str())
        .collect::<Vec<_>>()
        .join("; ");
    Status::with_error_details(Code::InvalidArgument, summary, details)
}

pub fn card_declined(message: &str, decline_code: Option<&str>) -> Status {
    // At most one metadata entry: the details are encoded from a map, and a replay must encode
    // to the same bytes as the first answer.
    let metadata = decline_code
        .map(|code| HashMap::from([(reason::DECLINE_CODE.to_owned(), code.to_owned())]))
        .unwrap_or_default();
    Status::with_error_details(
        Code::FailedPrecondition,
        message,
        error_info(reason::CARD_DECLINED, metadata),
    )
}

/// The database did not answer (logged where the error is known).
pub fn database_unavailable() -> Status {
    retryable(
        Code::Unavailable,
        "the service is temporarily unavailable",
        reason::DATABASE_UNAVAILABLE,
        RETRY_SOON,
    )
}

/// A key whose charge was refunded: final, replayed as stored (no metadata, so a replay encodes
/// to the same bytes).
pub fn payment_refunded(message: &str) -> Status {
    Status::with_error_details(
        Code::FailedPrecondition,
        message,
        error_info(reason::PAYMENT_REFUNDED, HashMap::new()),
    )
}

pub fn ride_not_found() -> Status {
    simple(Code::NotFound, "ride not found", reason::RIDE_NOT_FOUND)
}

pub fn internal() -> Status {
    simple(Code::Internal, "internal error", reason::INTERNAL)
}

pub fn store_error(error: StoreError) -> Status {
    create_ride_error(error.into())
}

pub fn create_ride_error(error: CreateRideError) -> Status {
    match error {
        CreateRideError::KeyReused => simple(
            Code::FailedPrecondition,
            "this idempotency key was already used with different parameters",
            reason::IDEMPOTENCY_KEY_REUSED,
        ),
        CreateRideError::KeyInUse { waited } => retryable(
            Code::Aborted,
            "another request with this idempotency key is in progress",
            reason::IDEMPOTENCY_KEY_IN_USE,
            // A call that waited until its deadline served as its own back-off: its retry may
            // come at once, and waits again.
            if waited { Duration::ZERO } else { RETRY_SOON },
        ),
        CreateRideError::LockLost => retryable(
            Code::Aborted,
            "another attempt took over this idempotency key; retry to see its outcome",
            reason::IDEMPOTENCY_KEY_LOCK_LOST,
            RETRY_SOON,
        ),
        CreateRideError::Contended(error) => {
            tracing::warn!(error = %error_chain(&error), "giving up on a contended request");
            retryable(
                Code::Aborted,
                "the request conflicted with concurrent requests",
                reason::CONCURRENCY_CONFLICT,
                RETRY_SOON,
            )
        }
        CreateRideError::DatabaseUnavailable(error) => {
            tracing::error!(error = %error_chain(&error), "database unavailable");
            database_unavailable()
        }
        // Logged where it happened (`rides::ride_created`); a retry is served by a server whose
        // session stands, this one's own once its session is open again.
        CreateRideError::LivenessLost => database_unavailable(),
        CreateRideError::ProviderUnavailable(error) => {
            tracing::warn!(error = %error_chain(&error), "payment provider unavailable");
            retryable(
                Code::Unavailable,
                "the payment provider is temporarily unavailable; retry with the same idempotency key",
                reason::PAYMENT_PROVIDER_UNAVAILABLE,
                RETRY_PROVIDER,
            )
        }
        CreateRideError::LeftByOlderServer(point) => {
            tracing::error!(
                recovery_point = %point,
                "a key an older server left at {point}: run `workers admin keys upgrade` once no \
                 older api-server runs (docs/operations.md, \"Upgrading\")"
            );
            retryable(
                Code::Unavailable,
                "this idempotency key awaits the upgrade of an older server's keys; retry with \
                 the same key",
                reason::IDEMPOTENCY_KEY_NEEDS_UPGRADE,
                RETRY_PROVIDER,
            )
        }
        CreateRideError::Internal(error) => {
            tracing::error!(error = %error_chain(error.as_ref()), "internal error");
            internal()
        }
    }
}
