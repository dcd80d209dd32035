//! The connection pool. diesel-async's `AsyncPgConnection` speaks the PostgreSQL protocol in Rust
//! (tokio-postgres underneath), so no libpq is needed at run time.

use std::time::Duration;

use diesel_async::{
    AsyncPgConnection,
    pooled_connection::{AsyncDieselConnectionManager, PoolError as ManagerError},
};

pub type Pool = bb8::Pool<AsyncDieselConnectionManager<AsyncPgConnection>>;
pub type DbConn<'a> = bb8::PooledConnection<'a, AsyncDieselConnectionManager<AsyncPgConnection>>;
pub type PoolError = bb8::RunError<ManagerError>;

/// Builds a pool of at most `max_size` connections. No connection is opened until one is needed,
/// so a process can start (and report NOT_SERVING) while the database is still coming up.
pub fn build_pool(database_url: &str, max_size: u32, connection_timeout: Duration) -> Pool {
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(database_url);
    bb8::Pool::builder()
        .max_size(max_size)
        .connection_timeout(connection_timeout)
        // A connection left mid-transaction by a cancelled future is discarded, never reused.
        .test_on_check_out(false)
        .build_unchecked(manager)
}
