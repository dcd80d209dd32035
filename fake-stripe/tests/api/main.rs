//! PaymentIntents API behaviour over real HTTP: shapes, idempotency, declines, validation,
//! auth, listing and search. One module per concern; the server and request helpers are the
//! crate's tests/common, shared with the other test targets.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod access;
mod charges;
#[path = "../common/mod.rs"]
mod common;
mod idempotency;
mod listing;
