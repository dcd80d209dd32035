//! The Rocket Rides database: Diesel schema, models, the connection pool and the embedded
//! migrations. Every process (api-server, workers, tests) reaches PostgreSQL through this crate,
//! so the schema has exactly one Rust definition.
//!
//! Layout:
//! - [`schema`]: table definitions as `diesel print-schema` writes them.
//! - [`models`]: a read struct and an insert struct per table.
//! - [`RecoveryPoint`]: the closed set of phases a key moves through, stored as TEXT.
//! - [`pool`]: the bb8 pool of diesel-async connections (pure Rust, no libpq).
//! - [`prepared`]: hand-written SQL (data-modifying CTEs) that is still prepared once per connection.
//! - [`store`]: [`StoreError`](store::StoreError), what every statement fails with, and the one
//!   retry policy for serialization failures and deadlocks.
//! - [`tls`]: [`connect`], the one way to open a connection, with TLS as `sslmode` asks.
//! - [`migrations`]: `migrations/` embedded in the binary and applied over an async connection.
//! - `testing` (feature `testing`): one database per test, cloned from a migrated template.

pub mod migrations;
pub mod models;
pub mod pool;
pub mod prepared;
mod recovery_point;
pub mod schema;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;

pub use pool::{DbConn, PlanCache, Pool, PoolError, build_pool};
pub use recovery_point::{RecoveryPoint, UnknownRecoveryPoint};
pub use tls::connect;
