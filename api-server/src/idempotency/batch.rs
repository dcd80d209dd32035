//! Concurrent requests' statements of one kind, sent to PostgreSQL together.
//!
//! PostgreSQL pays a fixed price per statement (protocol messages, executor start-up, locking
//! every relation and index the statement touches, and for a write the commit and its WAL flush)
//! that is several times the price of one more row. On this project's 2-core machine eight claims
//! in one statement cost the database about a quarter of what eight statements cost
//! (`docs/history/performance.md`, run 6). So the claim (`super::claim`) and the three write phases of
//! CreateRide (one file each under `crate::rides`) each have a [`Batcher`] that sends whatever requests are
//! waiting as one statement over arrays, one element per request.
//!
//! Batching never adds a wait: a request that finds fewer than `in_flight` batches running starts
//! one at once, alone if need be. Requests queue only while that many batches are already
//! running, and the next batch takes everything queued by then.
//!
//! A batch is one statement, so one implicit transaction: it commits whole or not at all. Each
//! request's rows in it are decided as its own statement would decide them (the statements say
//! how), so a request whose fence fails gets no row and writes nothing while the others commit.
//! What a batch cannot decide (a statement error, a panic) every request in it redoes alone with
//! its one-request statement, so a batch never turns one request's problem into another's error.
//! Only two failures are handed to every request instead: an exhausted pool (another try would
//! wait as long again) and a connection lost mid-statement, after which nobody knows whether the
//! batch committed; a phase must not be redone blindly then, and the caller's retry resumes from
//! what the database holds.

use std::{
    future::Future,
    mem,
    panic::AssertUnwindSafe,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel_async::AsyncPgConnection;
use futures_util::FutureExt;
use schema::{
    Pool,
    store::{ConflictRetry, StoreError, lost_connection_discarded, retry_transient},
};
use telemetry::attr;
use tokio::sync::oneshot;

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
    /// statements won over more concurrent ones at every step measured: four in flight served
    /// fewer replays than two (session 4), and once the claim and the charge's phase stopped
    /// waiting for the WAL flush, one in flight served 2,124–2,168 new rides/s at 64 clients
    /// against 1,811–1,870 with two and 1,203–1,383 with three or four, at 0.37–0.45 ms of
    /// database CPU per ride instead of 0.51–0.59 (`docs/history/performance.md`, run 20).
    fn default() -> Self {
        Batching {
            max_size: 32,
            in_flight: 1,
        }
    }
}

/// One statement over arrays that does for several requests what a one-request statement does
/// for each.
pub trait BatchStatement: Send + Sync + 'static {
    /// What one request contributes.
    type Item: Send + Sync + 'static;
    /// What the statement decided for one request.
    type Output: Send + 'static;
    /// The statement's name in metrics and logs.
    const NAME: &'static str;
    /// Whether a request may redo its work alone after the connection was lost mid-batch, not
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

/// Sends concurrent requests' statements of one kind to PostgreSQL together. Cheap to share: one
/// per statement per process.
pub struct Batcher<S: BatchStatement> {
    statement: S,
    pool: Pool,
    policy: ConflictRetry,
    batching: Batching,
    queue: Mutex<Queue<S>>,
    statements: AtomicU64,
    items: AtomicU64,
}

/// How many batch statements ran to completion and how many requests they decided, since start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchCounts {
    pub statements: u64,
    pub items: u64,
}

struct Queue<S: BatchStatement> {
    waiting: Vec<Pending<S>>,
    running: usize,
}

/// One request waiting for its batch.
struct Pending<S: BatchStatement> {
    item: S::Item,
    verdict: oneshot::Sender<Verdict<S::Output>>,
}

/// What a batch says about one of its requests. A request whose sender is dropped (the batch
/// failed or panicked) has no verdict and redoes its work alone.
enum Verdict<T> {
    Decided(T),
    /// No connection came free within the pool's timeout.
    PoolTimedOut,
    /// The connection failed mid-statement: the batch may or may not have committed.
    ConnectionLost(String),
}

impl<S: BatchStatement> Batcher<S> {
    pub fn new(statement: S, pool: Pool, policy: ConflictRetry, batching: Batching) -> Arc<Self> {
        Arc::new(Batcher {
            statement,
            pool,
            policy,
            batching: Batching {
                max_size: batching.max_size.max(1),
                in_flight: batching.in_flight.max(1),
            },
            queue: Mutex::new(Queue {
                waiting: Vec::new(),
                running: 0,
            }),
            statements: AtomicU64::new(0),
            items: AtomicU64::new(0),
        })
    }

    /// The pool the batches run on, for a request that must run alone.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The retry policy the batches run with, for a request that must run alone.
    pub fn policy(&self) -> ConflictRetry {
        self.policy
    }

    /// False when every request is to be sent alone (`max_size` 1).
    pub fn enabled(&self) -> bool {
        self.batching.max_size > 1
    }

    /// What batching has done so far: requests per statement is the saving it brings.
    pub fn counts(&self) -> BatchCounts {
        BatchCounts {
            statements: AtomicU64::load(&self.statements, Ordering::Relaxed),
            items: AtomicU64::load(&self.items, Ordering::Relaxed),
        }
    }

    /// What a batch decided for `item`, or `Ok(None)` if the request must do its work alone:
    /// batching is off, or the batch failed for a reason that may be this request's own.
    pub async fn submit(self: &Arc<Self>, item: S::Item) -> Result<Option<S::Output>, StoreError> {
        if !self.enabled() {
            return Ok(None);
        }
        let (sender, verdict) = oneshot::channel();
        self.enqueue(Pending {
            item,
            verdict: sender,
        });
        match verdict.await {
            Ok(Verdict::Decided(output)) => Ok(Some(output)),
            Ok(Verdict::PoolTimedOut) => Err(StoreError::Unavailable(bb8::RunError::TimedOut)),
            Ok(Verdict::ConnectionLost(message)) => Err(StoreError::ConnectionLost(
                DieselError::DatabaseError(DatabaseErrorKind::ClosedConnection, Box::new(message)),
            )),
            // The batch failed; this request's own statement will say how.
            Err(oneshot::error::RecvError { .. }) => Ok(None),
        }
    }

    /// Queues `pending`, and starts a batch if fewer than `in_flight` are running.
    fn enqueue(self: &Arc<Self>, pending: Pending<S>) {
        let batch = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.waiting.push(pending);
            if queue.running >= self.batching.in_flight {
                return;
            }
            queue.running += 1;
            self.take_batch(&mut queue)
        };
        tokio::spawn(Arc::clone(self).run_batch(batch));
    }

    fn take_batch(&self, queue: &mut Queue<S>) -> Vec<Pending<S>> {
        if queue.waiting.len() <= self.batching.max_size {
            mem::take(&mut queue.waiting)
        } else {
            queue.waiting.drain(..self.batching.max_size).collect()
        }
    }

    /// Runs batches until the queue is empty. Only a runner that saw the queue empty under the
    /// lock stops, so a queued request always has a runner that will take it.
    async fn run_batch(self: Arc<Self>, mut batch: Vec<Pending<S>>) {
        loop {
            // A panic drops the batch's senders: its requests then redo their work alone.
            let _ = AssertUnwindSafe(self.decide(batch)).catch_unwind().await;
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            if queue.waiting.is_empty() {
                queue.running -= 1;
                return;
            }
            batch = self.take_batch(&mut queue);
        }
    }

    async fn decide(&self, batch: Vec<Pending<S>>) {
        let (items, senders): (Vec<S::Item>, Vec<_>) = batch
            .into_iter()
            .map(|pending| (pending.item, pending.verdict))
            .unzip();
        let outputs = retry_transient(self.policy, || async {
            let mut conn = self.pool.get().await.map_err(StoreError::Unavailable)?;
            let result = self.statement.execute(&mut conn, &items).await;
            result.map_err(|error| lost_connection_discarded(&mut conn, error))
        })
        .await;
        let error = match outputs {
            Ok(outputs) => {
                let size = senders.len() as u64;
                self.statements.fetch_add(1, Ordering::Relaxed);
                self.items.fetch_add(size, Ordering::Relaxed);
                crate::metrics::metrics()
                    .batch_size
                    .record(size, &[attr("rides.batch.statement", S::NAME)]);
                for (sender, output) in senders.into_iter().zip(outputs) {
                    // A receiver that is gone no longer needs its verdict.
                    let _ = sender.send(Verdict::Decided(output));
                }
                return;
            }
            Err(StoreError::Unavailable(bb8::RunError::TimedOut)) => {
                for sender in senders {
                    let _ = sender.send(Verdict::PoolTimedOut);
                }
                return;
            }
            Err(StoreError::ConnectionLost(error)) if !S::REDO_AFTER_CONNECTION_LOSS => {
                let message = error.to_string();
                for sender in senders {
                    let _ = sender.send(Verdict::ConnectionLost(message.clone()));
                }
                return;
            }
            Err(error) => error,
        };
        tracing::debug!(
            statement = S::NAME,
            error = &error as &dyn std::error::Error,
            items = senders.len(),
            "a batch failed; its requests run alone"
        );
    }
}
