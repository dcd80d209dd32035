//! `rides-client`: how a Rust service calls `rides.v1.RideService`, with what Stripe's SDKs give
//! their callers for free.
//!
//! - **One key per logical request.** [`RidesClient::create_ride`] generates an idempotency key
//!   once ([`new_key`]) and sends it on every retry of that call, so the rider is charged at most
//!   once; [`RidesClient::create_ride_with_key`] takes the caller's key, and
//!   [`RidesClient::resume_ride`] a key the caller has sent before (a request resumed after a
//!   restart). Every resend says so (`idempotency-key-resent`), so the server looks the key up
//!   before it writes.
//! - **Retries only what is safe to retry**: [`RidesError`] has one variant per `ErrorInfo`
//!   reason of the table in docs/errors.md and [`RidesError::is_retryable`] is its "retry?" column;
//!   transport failures, where the request may or may not have arrived, are retried with the
//!   same key, which is what the key is for.
//! - **Waits for a duplicate in flight** (by default): a retry that finds the key's first attempt
//!   still running (the client gave up on it, or another process sent the same key) waits on the
//!   server for that attempt's answer and gets it as a replay, instead of
//!   `IDEMPOTENCY_KEY_IN_USE` and a back-off; [`RetryPolicy::idempotency_wait`] bounds or turns
//!   that off (`idempotency-wait` metadata).
//! - **Back-off** ([`RetryPolicy`]): exponential with full jitter, never shorter than the
//!   server's `RetryInfo`, inside an overall deadline that also caps each attempt.
//! - **What happened**: a [`Created`] carries the ride, the key, whether the answer was a replay
//!   (`idempotent-replayed`) and one [`AttemptRecord`] per attempt (answer, `RetryInfo`, the wait
//!   after it); a failed call's [`CallError`] carries the same log and its last error.
//! - **Transport**: TLS and mutual TLS through [`proto::client::endpoint`], the one place clients
//!   build a channel; W3C trace context injected into each attempt's metadata; spans with the
//!   OpenTelemetry RPC attributes (`rpc.system.name`, `rpc.method` fully qualified,
//!   `rpc.response.status_code` as the code's name) per call and per attempt.
//!
//! Layout: `client.rs` the calls and the one retry loop, `policy.rs` the back-off arithmetic,
//! `error.rs` the classification of answers, `credential.rs` who calls, `attempt.rs` what a call
//! reports, `span.rs` its spans and trace context. The same policy for callers in other languages is `proto/service_config.json`.

mod attempt;
mod client;
mod credential;
mod error;
mod policy;
mod span;

pub use attempt::{AttemptRecord, Created, Fetched};
pub use client::{AttemptObserver, RidesClient, new_key};
pub use credential::Credential;
pub use error::{CallError, RidesError};
pub use policy::RetryPolicy;
pub use proto::client::ClientTls;
