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

/// Builds a pool of at most `max_size` connections. No connection is opened until one is needed,
/// so a process can start (and report NOT_SERVING) while the database is still coming up.
pub fn build_pool(
    database_url: &str,
    max_size: u32,
    connection_timeout: Duration,
    plans: PlanCache,
) -> Pool {
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(database_url);
    bb8::Pool::builder()
        .max_size(max_size)
        .connection_timeout(connection_timeout)
        // A connection left mid-transaction by a cancelled future is discarded, never reused.
        .test_on_check_out(false)
        .connection_customizer(Box::new(SessionDefaults { plans }))
        .build_unchecked(manager)
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
