//! The Rocket Rides worker fleet: everything that happens after (or instead of) a CreateRide
//! request finishing in-band.
//!
//! Layout:
//! - [`config`]: typed configuration, read once from the environment.
//! - [`topology`]: the RabbitMQ layout (exchange, queues, dead-lettering); the versioned receipt
//!   message other teams consume is `contract::message`, shared with the api-server.
//! - [`amqp`]: connecting to RabbitMQ with back-off.
//! - [`jobs`]: the job registry: each job type's contract type and its one registration line.
//! - [`enqueuer`]: the transactionally-staged job drain, `staged_jobs` → RabbitMQ.
//! - [`consumer`]: the consumer every job type's queue shares (prefetch, batches, ack, nack,
//!   dead-letter, reconnect); a job type's worker is its [`consumer::JobHandler`].
//! - [`receipts`]: the receipt worker, RabbitMQ → SMTP, claimed in `receipt_claims` and
//!   deduplicated in `sent_receipts`.
//! - [`mailer`]: receipt e-mails over SMTP (lettre).
//! - [`relay_search`]: asks the relay whether it already holds a Message-ID (the crash window).
//! - [`completer`]: pushes abandoned idempotency keys to completion through the public API.
//! - [`reaper`]: retires expired keys, recording unfinished ones for a human first.
//! - [`reconciler`]: compares the provider's charges with the rides and records every mismatch
//!   in `reconciliation_findings`; refunds a charge no ride stands for only when asked.
//! - [`shutdown`] and [`backoff`]: the plumbing every loop shares.
//! - `testing` (feature): a RabbitMQ node of a test's own, plain or TLS.
//! - [`admin`]: the operator CLI (`workers admin …`, see `docs/operations.md`).
//!
//! Every worker has a `run_once` (one pass, returns a serialisable summary of counts) and a `run`
//! loop that calls it until the shutdown token is cancelled.
//!
//! The development SMTP server that local runs, the benchmark and these tests mail receipts to
//! is not part of the fleet: it is the `mail-sink` crate and binary.

pub mod admin;
pub mod amqp;
pub mod backoff;
pub mod completer;
pub mod config;
pub mod consumer;
pub mod enqueuer;
pub mod jobs;
pub mod mailer;
pub mod metrics;
pub mod reaper;
pub mod receipts;
pub mod reconciler;
pub mod redact;
pub mod relay_search;
pub mod shutdown;
#[cfg(feature = "testing")]
pub mod testing;
pub mod topology;
pub mod worker_loop;

pub use tokio_util::sync::CancellationToken;
