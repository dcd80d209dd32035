//! Concurrent requests' statements of one kind, sent to PostgreSQL together.
//!
//! PostgreSQL pays a fixed price per statement (protocol messages, executor start-up, locking
//! every relation and index the statement touches, and for a write the commit and its WAL flush)
//! that is several times the price of one more row; on a 2-core machine eight claims in one
//! statement cost the database about a quarter of what eight statements cost
//! (docs/performance.md). Every write of a request is one statement over arrays, one element per
//! request, so a request alone is a batch of one and a batch is the same text with more
//! elements. A [`Batcher`] per statement (the claim, the charge's record) sends whatever requests
//! are waiting as one statement.
//!
//! How it works, top to bottom:
//! 1. [`Batcher::run`] sends the request's item down an unbounded `mpsc` channel with a
//!    `oneshot` for its [`Verdict`], and waits for the verdict.
//! 2. `in_flight` runner tasks share the channel's receiver behind a `tokio::sync::Mutex`. They
//!    run on the database I/O thread ([`schema::io_thread`]) with the connections' own tasks, so
//!    that a batch's answer is read, decoded and handed out as soon as it arrives instead of
//!    waiting behind the gRPC tasks of the main runtime. An idle runner holds the mutex and waits
//!    in `recv_many`, which takes everything queued (up to `max_size`) as soon as there is one
//!    request; it then lets go of the mutex so that the next idle runner waits for the next
//!    batch, and runs its batch.
//! 3. So batching never adds a wait: a request that arrives while a runner is idle is sent at
//!    once, alone if need be. Requests queue only while every runner is busy, and the next free
//!    runner takes them all.
//! 4. Each batch's statement runs in a task of its own (`tokio::spawn`), so that a panic in it
//!    ends that run only: the runner hands each request its item back ([`Verdict::RunAlone`])
//!    and goes on with the next batch.
//!
//! A batch is one statement, so one implicit transaction: it commits whole or not at all (a claim
//! batch may read first, in a statement that commits nothing: `claim/statement.rs`). Each
//! request's rows in it are decided as they would be alone (the statements say how), so a
//! request whose fence fails gets no row and writes nothing while the others commit. What a
//! batch cannot decide (a statement error, a panic) every request in it runs again alone with
//! the same statement, so a batch never turns one request's problem into another's error. Two
//! failures are handed to every request instead: an exhausted pool (another try would wait as
//! long again), and for a statement not safe to run twice, a connection lost mid-statement, after
//! which nobody knows whether the batch committed.

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel_async::AsyncPgConnection;
use schema::{
    Pool,
    store::{ConflictRetry, StoreError, lost_connection_discarded, retry_transient},
};
use telemetry::attr;
use tokio::sync::{Mutex, mpsc, oneshot};

/// How one kind of statement is grouped into batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batching {
    /// The most requests one statement carries; 1 sends every request alone.
    pub max_size: usize,
    /// How many batch statements may run at once; requests beyond them wait for the next batch.
    pub in_flight: usize,
}

impl Default for Batching {
    /// One batch in flight per statement: while it runs, the next one fills. Fewer, fuller
    /// statements won over more concurrent ones at every step measured: with one in flight a
    /// new ride cost 0.37–0.45 ms of database CPU at 64 clients against 0.51–0.59 with two to
    /// four, and served the most rides (docs/history/performance.md).
    fn default() -> Self {
        Batching {
            max_size: 32,
            in_flight: 1,
        }
    }
}

/// One statement over arrays that does for several requests what it does for one.
pub trait BatchStatement: Send + Sync + 'static {
    /// What one request contributes.
    type Item: Send + Sync + 'static;
    /// What the statement decided for one request.
    type Output: Send + 'static;
    /// The statement's name in metrics and logs.
    const NAME: &'static str;
    /// Whether a request may run again alone after the connection was lost mid-batch, not
    /// knowing whether the batch committed. True only for a statement that is safe to run twice.
    const REDO_AFTER_CONNECTION_LOSS: bool;

    /// Runs the statement once for `items`, returning one output per item, in `items`' order
    /// (built by mapping `items`, so that no request can be left without its output).
    fn execute<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        items: &'a [Self::Item],
    ) -> impl Future<Output = Result<Vec<Self::Output>, DieselError>> + Send + 'a;
}

/// Sends concurrent requests' statements of one kind to PostgreSQL together: see the module
/// documentation. One per statement per process; its runners end when it is dropped.
pub struct Batcher<S: BatchStatement> {
    shared: Arc<Shared<S>>,
    queue: mpsc::UnboundedSender<Pending<S>>,
}

/// What the runners and the lone requests both use.
struct Shared<S: BatchStatement> {
    statement: S,
    pool: Pool,
    policy: ConflictRetry,
    max_size: usize,
    statements: AtomicU64,
    items: AtomicU64,
}

/// How many batch statements ran to completion and how many requests they decided, since start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchCounts {
    pub statements: u64,
    pub items: u64,
}

/// One request waiting for its batch.
struct Pending<S: BatchStatement> {
    item: S::Item,
    verdict: oneshot::Sender<Verdict<S::Item, S::Output>>,
}

/// What a batch says about one of its requests.
enum Verdict<I, T> {
    Decided(T),
    /// The batch could not decide it (a statement error or a panic): the request runs alone
    /// with its item, handed back.
    RunAlone(I),
    /// No connection came free within the pool's timeout.
    PoolTimedOut,
    /// The connection failed mid-statement: the batch may or may not have committed.
    ConnectionLost(String),
}

impl<S: BatchStatement> Batcher<S> {
    /// A batcher with its runners started (on the database I/O thread).
    pub fn new(statement: S, pool: Pool, policy: ConflictRetry, batching: Batching) -> Self {
        let shared = Arc::new(Shared {
            statement,
            pool,
            policy,
            max_size: batching.max_size.max(1),
            statements: AtomicU64::new(0),
            items: AtomicU64::new(0),
        });
        let (queue, receiver) = mpsc::unbounded_channel();
        if shared.max_size > 1 {
            let receiver = Arc::new(Mutex::new(receiver));
            for _ in 0..batching.in_flight.max(1) {
                let runner = run_batches(Arc::clone(&shared), Arc::clone(&receiver));
                drop(schema::io_thread::spawn(runner));
            }
        }
        Batcher { shared, queue }
    }

    /// The pool the statements run on, for a request's other statements.
    pub fn pool(&self) -> &Pool {
        &self.shared.pool
    }

    /// The retry policy the statements run with, for a request's other statements.
    pub fn policy(&self) -> ConflictRetry {
        self.shared.policy
    }

    /// The statement the batches run (a claim statement's counts of what it sent, say).
    pub fn statement(&self) -> &S {
        &self.shared.statement
    }

    /// What batching has done so far: requests per statement is the saving it brings.
    pub fn counts(&self) -> BatchCounts {
        BatchCounts {
            statements: self.shared.statements.load(Ordering::Relaxed),
            items: self.shared.items.load(Ordering::Relaxed),
        }
    }

    /// What the statement decided for `item`: in a batch with other requests when batching is
    /// on, else (or when its batch could not decide it) alone.
    pub async fn run(&self, item: S::Item) -> Result<S::Output, StoreError> {
        if self.shared.max_size == 1 {
            return self.shared.alone(item).await;
        }
        let (verdict, decided) = oneshot::channel();
        let verdict = match self.queue.send(Pending { item, verdict }) {
            // A runner always answers: it hands a batch it could not decide back item by item.
            Ok(()) => decided
                .await
                .map_err(|_| StoreError::Database(DieselError::NotFound))?,
            // No runner is left (the batcher is being dropped): the request keeps its item.
            Err(mpsc::error::SendError(pending)) => Verdict::RunAlone(pending.item),
        };
        match verdict {
            Verdict::Decided(output) => Ok(output),
            Verdict::RunAlone(item) => self.shared.alone(item).await,
            Verdict::PoolTimedOut => Err(StoreError::Unavailable(bb8::RunError::TimedOut)),
            Verdict::ConnectionLost(message) => Err(StoreError::ConnectionLost(
                DieselError::DatabaseError(DatabaseErrorKind::ClosedConnection, Box::new(message)),
            )),
        }
    }
}

/// A runner: takes the next batch whenever it is idle, runs its statement in a task of its own
/// (so that a panic ends that run only), and hands each request its verdict.
async fn run_batches<S: BatchStatement>(
    shared: Arc<Shared<S>>,
    receiver: Arc<Mutex<mpsc::UnboundedReceiver<Pending<S>>>>,
) {
    let mut batch = Vec::with_capacity(shared.max_size);
    loop {
        let taken = receiver
            .lock()
            .await
            .recv_many(&mut batch, shared.max_size)
            .await;
        if taken == 0 {
            // Every sender is gone: the batcher was dropped.
            return;
        }
        let (items, verdicts): (Vec<S::Item>, Vec<_>) = batch
            .drain(..)
            .map(|pending| (pending.item, pending.verdict))
            .unzip();
        let items = Arc::new(items);
        let run = tokio::spawn({
            let (shared, items) = (Arc::clone(&shared), Arc::clone(&items));
            async move { shared.execute(&items).await }
        });
        // A panic is a failed run: its requests run alone.
        let outputs = run.await.unwrap_or_else(|panic| {
            Err(StoreError::Database(DieselError::QueryBuilderError(
                panic.to_string().into(),
            )))
        });
        // The task has ended, and its clone of the items with it.
        match Arc::try_unwrap(items) {
            Ok(items) => shared.settle(outputs, items, verdicts),
            Err(_) => tracing::error!(statement = S::NAME, "a batch's items outlived its run"),
        }
    }
}

impl<S: BatchStatement> Shared<S> {
    /// Hands each request of a batch its verdict: its output, or its item back to run alone.
    fn settle(
        &self,
        outputs: Result<Vec<S::Output>, StoreError>,
        items: Vec<S::Item>,
        verdicts: Vec<oneshot::Sender<Verdict<S::Item, S::Output>>>,
    ) {
        // A request that is gone no longer needs its verdict.
        match outputs {
            Ok(outputs) => {
                let size = verdicts.len() as u64;
                self.statements.fetch_add(1, Ordering::Relaxed);
                self.items.fetch_add(size, Ordering::Relaxed);
                crate::metrics::metrics()
                    .batch_size
                    .record(size, &[attr("rides.batch.statement", S::NAME)]);
                for (verdict, output) in verdicts.into_iter().zip(outputs) {
                    let _ = verdict.send(Verdict::Decided(output));
                }
            }
            Err(StoreError::Unavailable(bb8::RunError::TimedOut)) => {
                for verdict in verdicts {
                    let _ = verdict.send(Verdict::PoolTimedOut);
                }
            }
            Err(StoreError::ConnectionLost(error)) if !S::REDO_AFTER_CONNECTION_LOSS => {
                let message = error.to_string();
                for verdict in verdicts {
                    let _ = verdict.send(Verdict::ConnectionLost(message.clone()));
                }
            }
            Err(error) => {
                tracing::debug!(
                    statement = S::NAME,
                    error = &error as &dyn std::error::Error,
                    items = verdicts.len(),
                    "a batch failed; its requests run alone"
                );
                for (verdict, item) in verdicts.into_iter().zip(items) {
                    let _ = verdict.send(Verdict::RunAlone(item));
                }
            }
        }
    }

    /// One run of the statement for `items` on a pooled connection, retried on transient
    /// conflicts.
    async fn execute(&self, items: &[S::Item]) -> Result<Vec<S::Output>, StoreError> {
        retry_transient(self.policy, || async {
            let mut conn = self.pool.get().await.map_err(StoreError::Unavailable)?;
            let outputs = self.statement.execute(&mut conn, items).await;
            outputs.map_err(|error| lost_connection_discarded(&mut conn, error))
        })
        .await
    }

    /// The statement for `item` alone: a batch of one.
    async fn alone(&self, item: S::Item) -> Result<S::Output, StoreError> {
        let outputs = self.execute(std::slice::from_ref(&item)).await?;
        // `execute` maps its items to outputs, so there is exactly one.
        outputs
            .into_iter()
            .next()
            .ok_or(StoreError::Database(DieselError::NotFound))
    }
}
