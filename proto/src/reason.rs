//! The `google.rpc.ErrorInfo` of every error the api-server returns: its domain and the reasons
//! (the table in docs/errors.md). Clients branch on the reason, not the message, so these strings are part
//! of the wire contract; the server builds its statuses from them and `rides-client` parses them,
//! both from this one definition.

/// `ErrorInfo.domain` of every error.
pub const ERROR_DOMAIN: &str = "rides.rocketrides.io";

pub const MISSING_CREDENTIALS: &str = "MISSING_CREDENTIALS";
pub const INVALID_CREDENTIALS: &str = "INVALID_CREDENTIALS";
pub const ON_BEHALF_OF_NOT_ALLOWED: &str = "ON_BEHALF_OF_NOT_ALLOWED";
pub const ON_BEHALF_OF_REQUIRED: &str = "ON_BEHALF_OF_REQUIRED";
pub const INTERNAL_CREDENTIAL_NOT_ALLOWED: &str = "INTERNAL_CREDENTIAL_NOT_ALLOWED";
pub const RATE_LIMITED: &str = "RATE_LIMITED";
pub const INVALID_IDEMPOTENCY_KEY: &str = "INVALID_IDEMPOTENCY_KEY";
/// `idempotency-wait` is not a number of milliseconds (`INVALID_ARGUMENT`, nothing written).
pub const INVALID_IDEMPOTENCY_WAIT: &str = "INVALID_IDEMPOTENCY_WAIT";
pub const INVALID_RIDE_PARAMETERS: &str = "INVALID_RIDE_PARAMETERS";
pub const IDEMPOTENCY_KEY_REUSED: &str = "IDEMPOTENCY_KEY_REUSED";
pub const IDEMPOTENCY_KEY_IN_USE: &str = "IDEMPOTENCY_KEY_IN_USE";
pub const IDEMPOTENCY_KEY_LOCK_LOST: &str = "IDEMPOTENCY_KEY_LOCK_LOST";
pub const CONCURRENCY_CONFLICT: &str = "CONCURRENCY_CONFLICT";
pub const CARD_DECLINED: &str = "CARD_DECLINED";
/// Final, stored on the key and replayed (`FAILED_PRECONDITION`): the key's charge was refunded
/// (docs/money-safety.md), so it will never be a paid ride; booking again needs a new key.
pub const PAYMENT_REFUNDED: &str = "PAYMENT_REFUNDED";
pub const PAYMENT_PROVIDER_UNAVAILABLE: &str = "PAYMENT_PROVIDER_UNAVAILABLE";
pub const DATABASE_UNAVAILABLE: &str = "DATABASE_UNAVAILABLE";
/// `UNAVAILABLE`, retryable: the key was left at `started` or `charge_created` by an older server
/// (one that committed the charge's record apart from finishing the key), which this server does
/// not resume; an older server
/// still running resumes it, and `workers admin keys upgrade` retires or finishes it.
pub const IDEMPOTENCY_KEY_NEEDS_UPGRADE: &str = "IDEMPOTENCY_KEY_NEEDS_UPGRADE";
pub const RIDE_NOT_FOUND: &str = "RIDE_NOT_FOUND";
pub const INTERNAL: &str = "INTERNAL";

/// `ErrorInfo.metadata` key of a `CARD_DECLINED` error: the provider's decline code.
pub const DECLINE_CODE: &str = "decline_code";
