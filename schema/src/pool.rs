//! The connection pool. diesel-async's `AsyncPgConnection` speaks the PostgreSQL protocol in Rust
//! (tokio-postgres underneath), so no libpq is needed at run time.

use std::{future::Future, pin::Pin, time::Duration};

use diesel_async::{
    AsyncPgConnection, SimpleAsyncConnection,
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
        .connection_customizer(Box::new(ReadCommitted))
        .build_unchecked(manager)
}

/// Makes READ COMMITTED the isolation level of every transaction that does not name its own, on
/// every pooled connection, whatever the server's `default_transaction_isolation`: the atomic
/// phases are single statements in implicit transactions, and their concurrency reasoning
/// (a locked row is re-checked at its newest version) is READ COMMITTED's.
#[derive(Debug)]
struct ReadCommitted;

impl bb8::CustomizeConnection<AsyncPgConnection, ManagerError> for ReadCommitted {
    fn on_acquire<'a>(
        &'a self,
        connection: &'a mut AsyncPgConnection,
    ) -> Pin<Box<dyn Future<Output = Result<(), ManagerError>> + Send + 'a>> {
        Box::pin(async move {
            connection
                .batch_execute(
                    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED",
                )
                .await
                .map_err(ManagerError::QueryError)
        })
    }
}
