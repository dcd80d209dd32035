//! CreateRide over real gRPC against a real PostgreSQL and fake-stripe over HTTP: the cases of the
//! Ruby reference's suite, ported, and the ones this service adds. Each test asserts the status,
//! the reason and the database state it leaves. One module per concern: what a key answers, what is
//! refused before anything is written, the provider's failures, the key's lock and its recovery, and
//! many requests at once.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod answers;
mod concurrency;
mod locks;
mod provider;
mod refusals;
