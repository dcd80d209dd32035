//! The request and response metadata (HTTP/2 headers) of the `rides.v1` API, as docs/errors.md's
//! contract names them: one definition for the server that reads and writes them and the clients
//! that send and read them.

/// Request, CreateRide: the idempotency key (20 to 255 visible ASCII characters, per user).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Request, every call: `Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";
/// Request, CreateRide: how long, in milliseconds, the call may wait for an attempt in flight
/// with the same key to finish (`0`: not at all, answer `IDEMPOTENCY_KEY_IN_USE` at once). Absent:
/// up to the server's `IDEMPOTENCY_WAIT_MAX_MS`; always within the call's deadline.
pub const IDEMPOTENCY_WAIT: &str = "idempotency-wait";
/// Request, CreateRide: `true` when the caller has sent this key before (a retry of an attempt
/// whose answer was lost, a request resumed after the caller restarted). A hint, never an answer:
/// the server then looks the key up before it writes anything, which makes a replay cheaper and a
/// fresh key dearer. Any other value, or none, is a first send.
pub const IDEMPOTENCY_KEY_RESENT: &str = "idempotency-key-resent";
/// Request, with the internal credential only: the id of the user the call is made for.
pub const ON_BEHALF_OF_USER: &str = "on-behalf-of-user";
/// Response, CreateRide: `true` when the answer is the stored answer of a finished key.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// Response, CreateRide, once the key exists: when the reaper retires it (RFC 3339).
pub const IDEMPOTENCY_KEY_EXPIRES_AT: &str = "idempotency-key-expires-at";
