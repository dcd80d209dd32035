//! The connection pool. diesel-async's `AsyncPgConnection` speaks the PostgreSQL protocol in Rust
//! (tokio-postgres underneath), so no libpq is needed at run time.

use std::{future::Future, pin::Pin, time::Duration};

use diesel_async::{
    AsyncPgConnection, SimpleAsyncConnection,
    pooled_connection::{
        AsyncDieselConnectionManager, ManagerConfig, PoolError as ManagerError, PoolableConnection,
    },
};

/// `DATABASE_URL`'s default in every process: the local database `deploy/local/` creates.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/rocket_rides";

pub type Pool = bb8::Pool<Manager>;
pub type DbConn<'a> = bb8::PooledConnection<'a, Manager>;
pub type PoolError = bb8::RunError<ManagerError>;

/// diesel-async's connection manager, with a check-out test that costs no round trip.
///
/// A connection whose server went away (a restart, a failover, `pg_terminate_backend`) is
/// usually returned to the pool before its client has read the socket's end, so the pool's
/// check on return passes it as healthy and the next request to take it fails with a lost
/// connection. By check-out the client has seen the end: testing then whether the connection is
/// closed discards it there and hands out another, where diesel-async's own check-out test would
/// send a query every time.
pub struct Manager(AsyncDieselConnectionManager<AsyncPgConnection>);

impl bb8::ManageConnection for Manager {
    type Connection = AsyncPgConnection;
    type Error = ManagerError;

    async fn connect(&self) -> Result<AsyncPgConnection, ManagerError> {
        self.0.connect().await
    }

    async fn is_valid(&self, connection: &mut AsyncPgConnection) -> Result<(), ManagerError> {
        if PoolableConnection::is_broken(connection) {
            Err(ManagerError::QueryError(
                diesel::result::Error::BrokenTransactionManager,
            ))
        } else {
            Ok(())
        }
    }

    fn has_broken(&self, connection: &mut AsyncPgConnection) -> bool {
        self.0.has_broken(connection)
    }
}

/// How PostgreSQL plans the pool's prepared statements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanCache {
    /// PostgreSQL's default: custom plans for a statement's first executions, then a generic plan
    /// only if its estimated cost is no worse. Right for statements whose best plan depends on
    /// the values bound (a range scan over a cut-off date, say).
    Auto,
    /// Plan every prepared statement once per connection (`plan_cache_mode =
    /// force_generic_plan`). Right for a pool whose statements all find rows by key: the
    /// default keeps re-planning a statement whose custom plan merely *looks* cheaper — a
    /// data-modifying CTE, or one whose arrays it sizes from the values — and then planning
    /// costs more than running it.
    Generic,
}

/// Makes the pool discard `connection` when it is returned instead of handing it out again: for a
/// connection whose server just went away, which may not look closed yet.
pub fn discard_on_return(connection: &mut AsyncPgConnection) {
    use diesel_async::{AsyncConnection, TransactionManager};
    <AsyncPgConnection as AsyncConnection>::TransactionManager::transaction_manager_status_mut(
        connection,
    )
    .set_in_error();
}

/// Builds a pool of at most `max_size` connections. No connection is opened until one is needed,
/// so a process can start (and report NOT_SERVING) while the database is still coming up.
pub fn build_pool(
    database_url: &str,
    max_size: u32,
    connection_timeout: Duration,
    plans: PlanCache,
) -> Pool {
    // `connect` honours `sslmode`; diesel-async's own setup would connect in plaintext.
    let mut config = ManagerConfig::default();
    config.custom_setup = Box::new(crate::tls::connect_boxed);
    let manager = Manager(
        AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(database_url, config),
    );
    bb8::Pool::builder()
        .max_size(max_size)
        .connection_timeout(connection_timeout)
        // `Manager::is_valid`: no round trip. A connection left mid-transaction by a cancelled
        // future is discarded on return already (`has_broken`).
        .test_on_check_out(true)
        .connection_customizer(Box::new(SessionDefaults { plans }))
        .error_sink(Box::new(LogConnectionErrors))
        .build_unchecked(manager)
}

/// Logs why a connection could not be opened (refused, authentication failed, TLS): a request
/// that then times out waiting for the pool only learns that it timed out.
#[derive(Clone, Copy, Debug)]
struct LogConnectionErrors;

impl bb8::ErrorSink<ManagerError> for LogConnectionErrors {
    fn sink(&self, error: ManagerError) {
        tracing::error!(error = %telemetry::error_chain(&error), "cannot open a database connection");
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<ManagerError>> {
        Box::new(*self)
    }
}

/// Makes READ COMMITTED the isolation level of every transaction that does not name its own, on
/// every pooled connection, whatever the server's `default_transaction_isolation`: the atomic
/// phases are single statements in implicit transactions, and their concurrency reasoning
/// (a locked row is re-checked at its newest version) is READ COMMITTED's. Also sets the
/// [`PlanCache`] mode.
#[derive(Debug)]
struct SessionDefaults {
    plans: PlanCache,
}

impl bb8::CustomizeConnection<AsyncPgConnection, ManagerError> for SessionDefaults {
    fn on_acquire<'a>(
        &'a self,
        connection: &'a mut AsyncPgConnection,
    ) -> Pin<Box<dyn Future<Output = Result<(), ManagerError>> + Send + 'a>> {
        Box::pin(async move {
            let settings = match self.plans {
                PlanCache::Auto => {
                    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
                }
                PlanCache::Generic => {
                    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED; \
                     SET plan_cache_mode = force_generic_plan"
                }
            };
            connection
                .batch_execute(settings)
                .await
                .map_err(ManagerError::QueryError)
        })
    }
}
