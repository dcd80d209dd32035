//! The rest of the API surface: GetRide, health, reflection, the completer's internal credential,
//! the constraints the schema enforces, conflict retries, and the command line. One module per
//! part of the surface.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod command_line;
mod database;
mod on_behalf_of;
mod rpcs;
