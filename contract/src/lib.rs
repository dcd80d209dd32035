//! The contract between the api-server and the worker fleet: everything both sides write or read
//! and must therefore agree on by construction, not by two copies kept in step.
//!
//! - [`outcome`]: the final outcome stored on a finished key ([`Outcome`], its stored form
//!   [`StoredResponse`] and the ride as the API shows it, [`RideView`]). The api-server's last
//!   phase stores it and every replay rebuilds the answer from it; `workers admin key finish`
//!   stores exactly the same when an operator finishes a stuck key.
//! - [`jobs`]: the jobs staged in `staged_jobs` inside the business transaction and drained by the
//!   enqueuer, each a typed struct that builds and parses its own `job_args` ([`BackgroundJob`]).
//! - [`message`]: the versioned messages on the `rides` exchange, which other teams consume.
//! - [`key`]: the rules of an idempotency key that more than one process applies: the key the
//!   provider sees for its charge and when a lock may be taken over.
//! - [`writes`]: the statements that move a key on and that more than one process runs
//!   (recording a charge, finishing a key, releasing its lock), each one SQL text with its
//!   parameters bound by name.
//! - [`ownership`]: which PaymentIntents on the shared provider account are ours, the one rule
//!   the api-server's charge search and the reconciler both apply.
//! - [`request`]: the request a key is bound to, as the api-server stores it on the key and the
//!   completer reads it back to retry it.
//!
//! It sits above `schema` (the database crate, whose `Ride` the views are built from) and below
//! both services, which is why neither service depends on the other.

pub mod jobs;
pub mod key;
pub mod message;
pub mod outcome;
pub mod ownership;
pub mod request;
pub mod writes;

pub use jobs::{BackgroundJob, JobToStage, ReceiptJob};
pub use outcome::{
    CorruptStoredResponse, Outcome, PAYMENT_ACCEPTED, PAYMENT_REFUNDED, RideView, StoredResponse,
};
pub use request::StoredRideRequest;
