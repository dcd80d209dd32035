//! Looking up tokens that are not known yet, without letting made-up tokens take the database.
//!
//! - **Places.** At most `places` lookups run at once (sized from the database pool, so known
//!   callers always keep connections for their claims). A place is held for the one indexed read
//!   of the user by token digest and released as soon as it answers: never across the claim or
//!   the provider call.
//! - **A short, fair queue.** A call that finds every place taken waits in FIFO order (tokio's
//!   semaphore is fair) for at most `max_wait`, and at most `max_waiting` calls wait at once;
//!   beyond either it is refused as busy. A cold burst from a backend (every rider's token cold
//!   after a restart) is thus served at the lookups' pace instead of refused.
//! - **Single flight.** Concurrent calls with the same cold token share one lookup: the first
//!   queues and reads, the others wait for its answer. If the first caller goes away mid-lookup,
//!   a waiting one takes over (`OnceCell`).
//! - **Batched.** The lookups that hold a place at once are read by one statement
//!   (`token_lookup.sql`, through the claims' [`Batcher`]): after a restart every rider's token
//!   is cold, and a statement per token cost replays about 45 % of their rate when most calls were
//!   a rider's first (docs/performance.md, run 32).

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use diesel::{
    QueryableByName,
    result::Error as DieselError,
    sql_types::{Array, BigInt, Bytea, Nullable},
};
use diesel_async::AsyncPgConnection;
use schema::{Pool, store::ConflictRetry};
use tokio::sync::{OnceCell, Semaphore};

use crate::idempotency::{BatchCounts, BatchStatement, Batcher, Batching};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LookupConfig {
    /// Lookups that may run at once.
    pub places: usize,
    /// Calls that may wait for a place at once.
    pub max_waiting: usize,
    /// How long a call waits for a place before it is refused.
    pub max_wait: Duration,
}

/// What a lookup found: the token's user, or that no user has it.
pub type Found = Option<i64>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("every token-lookup place is taken and the queue is full or too slow")]
    Busy,
    #[error("the database did not answer the token lookup")]
    Unavailable,
}

/// One lookup, shared by every call with its token while it runs.
type SharedLookup = Arc<OnceCell<Result<Found, LookupError>>>;

pub struct TokenLookups {
    config: LookupConfig,
    places: Arc<Semaphore>,
    waiting: AtomicUsize,
    in_flight: InFlight,
    reads: Batcher<ReadTokens>,
}

impl TokenLookups {
    /// Lookups on `pool`, batched at the claims' defaults (one statement in flight, up to 32
    /// digests in it).
    pub fn new(config: LookupConfig, pool: Pool) -> TokenLookups {
        TokenLookups {
            config,
            places: Arc::new(Semaphore::new(config.places)),
            waiting: AtomicUsize::new(0),
            in_flight: Mutex::new(HashMap::new()),
            reads: Batcher::new(
                ReadTokens,
                pool,
                ConflictRetry::default(),
                Batching::default(),
            ),
        }
    }

    /// The user whose token has `digest`, looked up once for all concurrent callers.
    pub async fn lookup(&self, digest: &[u8; 32]) -> Result<Found, LookupError> {
        let joined = Joined::join(&self.in_flight, digest);
        *joined.cell.get_or_init(|| self.queued_read(digest)).await
    }

    /// Tokens being looked up now.
    pub fn in_flight(&self) -> usize {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The lookup statements run so far and the digests they read: digests per statement is
    /// what batching saves.
    pub fn counts(&self) -> BatchCounts {
        self.reads.counts()
    }

    /// Calls waiting for a lookup place now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    async fn queued_read(&self, digest: &[u8; 32]) -> Result<Found, LookupError> {
        let place = match Arc::clone(&self.places).try_acquire_owned() {
            Ok(place) => place,
            Err(_) => {
                let Some(_in_queue) = Waiting::enter(&self.waiting, self.config.max_waiting) else {
                    counted("busy");
                    return Err(LookupError::Busy);
                };
                let places = Arc::clone(&self.places);
                match tokio::time::timeout(self.config.max_wait, places.acquire_owned()).await {
                    Ok(Ok(place)) => place,
                    // Timed out, or the semaphore closed (it never is).
                    Ok(Err(_)) | Err(_) => {
                        counted("busy");
                        return Err(LookupError::Busy);
                    }
                }
            }
        };
        let user = self.reads.run(*digest).await;
        drop(place);
        match user {
            Ok(user) => {
                counted(if user.is_some() { "known" } else { "unknown" });
                Ok(user)
            }
            Err(error) => {
                counted("unavailable");
                tracing::warn!(error = %telemetry::error_chain(&error), "token lookup failed");
                Err(LookupError::Unavailable)
            }
        }
    }
}

schema::statement! {
    /// `token_lookup.sql`, one element per digest.
    struct TokenLookup = include_str!("token_lookup.sql");
    {
        digests: Array<Bytea> = Vec<Vec<u8>>,
    }
}

/// A row of `token_lookup.sql`.
#[derive(QueryableByName)]
struct TokenUser {
    #[diesel(sql_type = Nullable<BigInt>)]
    id: Option<i64>,
}

/// The token lookups holding a place at once, as one statement.
pub struct ReadTokens;

impl BatchStatement for ReadTokens {
    type Item = [u8; 32];
    type Output = Found;
    const NAME: &'static str = "token_lookup";
    // A read: running it again changes nothing.
    const REDO_AFTER_CONNECTION_LOSS: bool = true;

    async fn execute(
        &self,
        conn: &mut AsyncPgConnection,
        digests: &[[u8; 32]],
    ) -> Result<Vec<Found>, DieselError> {
        let statement = TokenLookup {
            digests: digests.iter().map(|digest| digest.to_vec()).collect(),
        };
        let rows: Vec<TokenUser> = statement.load(conn).await?;
        // One row per digest by the statement's shape; anything else is decided alone.
        if rows.len() != digests.len() {
            return Err(DieselError::DeserializationError(
                format!("{} rows for {} token digests", rows.len(), digests.len()).into(),
            ));
        }
        Ok(rows.into_iter().map(|row| row.id).collect())
    }
}

fn counted(outcome: &'static str) {
    crate::metrics::metrics()
        .token_lookups
        .add(1, &[telemetry::attr("outcome", outcome)]);
}

/// The lookups running, by token digest: each with the calls that share it.
type InFlight = Mutex<HashMap<[u8; 32], (SharedLookup, usize)>>;

/// One call's part in a shared lookup, given up however the call ends: tonic drops a handler
/// whose caller's deadline expired mid-lookup, and an entry left behind would stay in the map
/// for good.
struct Joined<'a> {
    in_flight: &'a InFlight,
    digest: [u8; 32],
    cell: SharedLookup,
}

impl<'a> Joined<'a> {
    fn join(in_flight: &'a InFlight, digest: &[u8; 32]) -> Joined<'a> {
        let mut map = in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        let (cell, calls) = map.entry(*digest).or_default();
        *calls += 1;
        Joined {
            in_flight,
            digest: *digest,
            cell: Arc::clone(cell),
        }
    }
}

impl Drop for Joined<'_> {
    /// Removes the entry once it has answered (later calls look up afresh), or when the last
    /// call sharing it has gone.
    fn drop(&mut self) {
        let mut map = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some((current, calls)) = map.get_mut(&self.digest) else {
            return;
        };
        if !Arc::ptr_eq(current, &self.cell) {
            return;
        }
        *calls = calls.saturating_sub(1);
        if *calls == 0 || self.cell.initialized() {
            map.remove(&self.digest);
        }
    }
}

/// One call's place in the queue, given back however the wait ends (a caller that hangs up
/// drops it mid-wait).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn enter(waiting: &'a AtomicUsize, max: usize) -> Option<Waiting<'a>> {
        let guard = Waiting(waiting);
        (waiting.fetch_add(1, Ordering::AcqRel) < max).then_some(guard)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lookup_whose_callers_leave_leaves_no_entry_behind() {
        // No place: every lookup waits in the queue and never reaches the database.
        let pool = schema::build_pool(
            "postgres://127.0.0.1:1/unused",
            1,
            Duration::from_millis(10),
            schema::PlanCache::Auto,
        );
        let lookups = TokenLookups::new(
            LookupConfig {
                places: 0,
                max_waiting: 8,
                max_wait: Duration::from_secs(60),
            },
            pool,
        );
        let brief = Duration::from_millis(20);
        // A caller whose deadline expires mid-lookup (tonic drops its handler).
        let gone = tokio::time::timeout(brief, lookups.lookup(&[1; 32])).await;
        assert!(gone.is_err());
        assert_eq!(lookups.in_flight(), 0);
        assert_eq!(lookups.waiting(), 0);
        // Two callers share a lookup; the first leaves, and the entry stays for the second.
        let mut staying = Box::pin(lookups.lookup(&[2; 32]));
        assert!(tokio::time::timeout(brief, &mut staying).await.is_err());
        let leaving = tokio::time::timeout(brief, lookups.lookup(&[2; 32])).await;
        assert!(leaving.is_err());
        assert_eq!(lookups.in_flight(), 1);
        drop(staying);
        assert_eq!(lookups.in_flight(), 0);
    }
}
