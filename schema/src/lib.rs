//! The Rocket Rides database crate. Its name is `schema` because the project's top-level layout
//! is fixed by its brief, but it owns everything about reaching PostgreSQL, not only the schema:
//! the Diesel tables and models, the connection pool and every connection's TLS, prepared
//! hand-written SQL, the errors every statement fails with and the one retry policy, the embedded
//! migrations, and per-test databases. Every process (api-server, workers, tests) reaches
//! PostgreSQL through this crate, so the schema has exactly one Rust definition. What the
//! services agree on *about* the rows (the stored outcome, the jobs, the key's fence) is the
//! `contract` crate's, above this one.
//!
//! Layout:
//! - [`schema`]: table definitions as `diesel print-schema` writes them.
//! - [`models`]: a read struct and an insert struct per table.
//! - [`RecoveryPoint`]: the closed set of phases a key moves through, stored as TEXT.
//! - [`FindingKind`]: the closed set of mismatches the reconciler records, stored as TEXT.
//! - [`JsonText`]: a `jsonb` value carried as its text, for values only stored and handed back.
//! - [`io_thread`]: the thread every pooled connection's I/O runs on, and the batch runners with it.
//! - [`pool`]: the bb8 pool of diesel-async connections (pure Rust, no libpq).
//! - [`prepared`]: hand-written SQL (data-modifying CTEs) that is still prepared once per connection.
//! - [`store`]: [`StoreError`](store::StoreError), what every statement fails with, and the one
//!   retry policy for serialization failures and deadlocks.
//! - [`tls`]: [`connect`], the one way to open a connection, with TLS as `sslmode` asks.
//! - [`liveness`]: this process's presence in PostgreSQL, which names the holder of the key
//!   locks it takes and lets another process see at once that the holder is gone.
//! - [`migrations`]: `migrations/` embedded in the binary and applied over an async connection.
//! - `testing` (feature `testing`): one database per test, cloned from a migrated template.

mod finding_kind;
pub mod io_thread;
mod json_text;
pub mod liveness;
pub mod migrations;
pub mod models;
pub mod pool;
pub mod prepared;
mod recovery_point;
pub mod schema;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
mod text_enum;
pub mod tls;

pub use finding_kind::{FindingKind, UnknownFindingKind};
pub use json_text::JsonText;
pub use pool::{DEFAULT_DATABASE_URL, DbConn, PlanCache, Pool, PoolError, build_pool};
pub use recovery_point::{RecoveryPoint, UnknownRecoveryPoint};
pub use tls::{connect, database_url};
