//! The transactionally-staged job drain: moves committed `staged_jobs` rows to RabbitMQ.
//!
//! One batch is one PostgreSQL transaction:
//!
//! 1. `SELECT … ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`: rows of uncommitted transactions are
//!    invisible (a rolled-back job is never seen), and rows another enqueuer is publishing right
//!    now are skipped, so several enqueuers share the work instead of queueing behind one
//!    advisory lock and, in the normal case, never publish the same job twice.
//! 2. Publish each job (persistent, `mandatory`, `message_id` = job id, trace context in the
//!    headers) and wait for the broker's confirms.
//! 3. `DELETE … WHERE id = ANY(confirmed ids)`, then commit.
//!
//! Only jobs the broker confirmed *and* routed to a queue are deleted: a returned (unroutable)
//! or nacked message, or one whose confirm never came because the connection dropped, stays
//! staged and is published again later. Unlike the reference implementation, which deletes
//! `id <= max(id of the batch)` and so also deletes jobs committed with a lower id while the
//! batch was in flight, nothing is ever deleted that was not published. If the commit itself
//! fails after the broker confirmed, the jobs are published again: delivery is at-least-once
//! and consumers deduplicate.
//!
//! A returned or nacked job is *set aside* in the same transaction: its `attempts` go up and
//! `next_attempt_at` moves to `ENQUEUER_BACKOFF_BASE_MS * 2^(attempts - 1)` from now, capped at
//! `ENQUEUER_BACKOFF_MAX_MS`, and the select skips it until then. Without this the oldest
//! `ENQUEUER_BATCH_SIZE` unroutable jobs (a job type deployed before its consumer) would fill every
//! batch and stop the receipts behind them. After `ENQUEUER_MAX_ATTEMPTS` the job is *parked*
//! (`parked_at`): never selected again until a human clears it (`workers admin backlog` lists it).
//! Since every selected job is either deleted or set aside, each batch makes progress and a pass
//! ends once fewer than a batch of jobs is due.
//!
//! Shutdown is checked between batches, never inside one: the batch in flight is confirmed and
//! committed (or, unconfirmed, left staged) and the loop returns; the rest of the backlog is left
//! for the next process. The enqueuer polls; it does not LISTEN (see the
//! `drop_staged_jobs_notify` migration).

use std::time::Duration;

use diesel_async::AsyncConnection;
use lapin::{Channel, options::ConfirmSelectOptions};
use schema::{Pool, PoolError};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{
    amqp::AmqpSession,
    backoff::Backoff,
    config::EnqueuerConfig,
    metrics::{self, Handled},
    topology::Topology,
    worker_loop::{self, Next, Passes},
};

mod batch;
mod publish;

use self::{batch::*, publish::*};

#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error("no database connection available")]
    Pool(#[from] PoolError),
    #[error("database error")]
    Database(#[from] diesel::result::Error),
    #[error("RabbitMQ error")]
    Broker(#[from] lapin::Error),
    #[error("the broker did not confirm the batch within {0:?}")]
    ConfirmTimeout(Duration),
}

/// Counts of one pass (one or more batches).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EnqueueSummary {
    pub batches: u64,
    /// Confirmed by the broker, routed, and deleted from `staged_jobs`.
    pub published: u64,
    /// Returned by the broker as unroutable; left staged.
    pub returned: u64,
    /// Negatively confirmed by the broker; left staged.
    pub nacked: u64,
    /// Returned or nacked jobs given a back-off (`next_attempt_at`); the drain went on past them.
    pub set_aside: u64,
    /// Returned or nacked jobs that reached `ENQUEUER_MAX_ATTEMPTS` and now wait for a human.
    pub parked: u64,
}

impl EnqueueSummary {
    /// Counts this summary in the worker's metric, by outcome.
    pub(crate) fn record(&self) {
        metrics::count(Handled::Enqueued, "published", self.published);
        metrics::count(Handled::Enqueued, "returned", self.returned);
        metrics::count(Handled::Enqueued, "nacked", self.nacked);
        metrics::count(Handled::Enqueued, "set_aside", self.set_aside);
        metrics::count(Handled::Enqueued, "parked", self.parked);
    }
}

impl EnqueueSummary {
    fn add(&mut self, other: &EnqueueSummary) {
        self.batches += other.batches;
        self.published += other.published;
        self.returned += other.returned;
        self.nacked += other.nacked;
        self.set_aside += other.set_aside;
        self.parked += other.parked;
    }
}

/// What one batch did; `selected` tells whether the table may hold more.
struct BatchOutcome {
    selected: usize,
    summary: EnqueueSummary,
    /// A broker failure part-way: the confirmed part was still deleted and committed.
    error: Option<EnqueueError>,
}

pub struct Enqueuer {
    pool: Pool,
    amqp_url: String,
    topology: Topology,
    config: EnqueuerConfig,
    session: Option<AmqpSession>,
}

impl Enqueuer {
    pub fn new(pool: Pool, amqp_url: &str, topology: Topology, config: EnqueuerConfig) -> Enqueuer {
        Enqueuer {
            pool,
            amqp_url: amqp_url.to_owned(),
            topology,
            config,
            session: None,
        }
    }

    /// One pass: drains batches until no more jobs are due (set-aside and parked jobs are not).
    /// A broker failure ends the pass with an error after the confirmed part was committed; the
    /// next call reconnects.
    pub async fn run_once(&mut self) -> Result<EnqueueSummary, EnqueueError> {
        self.run_pass(&CancellationToken::new()).await
    }

    /// [`Enqueuer::run_once`], but `stop` ends the pass after the batch in flight.
    pub async fn run_pass(
        &mut self,
        stop: &CancellationToken,
    ) -> Result<EnqueueSummary, EnqueueError> {
        let mut total = EnqueueSummary::default();
        loop {
            let outcome = self.drain_batch().await?;
            total.add(&outcome.summary);
            outcome.summary.record();
            if let Some(error) = outcome.error {
                tracing::warn!(published = total.published, "enqueuer pass interrupted");
                return Err(error);
            }
            let limit = usize::try_from(self.config.batch_size).unwrap_or(usize::MAX);
            let stopping = stop.is_cancelled();
            if stopping && outcome.selected == limit {
                tracing::info!(
                    published = total.published,
                    "shutdown requested: batch finished, the rest stays staged"
                );
            }
            if outcome.selected < limit || stopping {
                if let Ok(mut conn) = self.pool.get().await {
                    crate::metrics::observe_backlog(&mut conn).await;
                }
                return Ok(total);
            }
        }
    }

    /// Runs passes until `shutdown` is cancelled. The batch in progress is finished first, so a
    /// batch is never cut between publishing and deleting, but the backlog behind it is not. An
    /// idle enqueuer polls, backing off up to `idle_max`. (It does not LISTEN: a NOTIFY per staged
    /// job would serialise every CreateRide's commit across the database; see the
    /// `drop_staged_jobs_notify` migration.)
    pub async fn run(self, shutdown_token: CancellationToken) -> EnqueueSummary {
        let idle = Backoff::new(Duration::from_millis(50), self.config.idle_max);
        let mut passes = EnqueuerPasses {
            enqueuer: self,
            stop: shutdown_token.clone(),
            idle,
            total: EnqueueSummary::default(),
        };
        let failing = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        worker_loop::run_passes(&mut passes, &shutdown_token, failing).await;
        if let Some(session) = passes.enqueuer.session.take() {
            session.close().await;
        }
        passes.total
    }

    async fn channel(&mut self) -> Result<Channel, EnqueueError> {
        if let Some(session) = &self.session
            && session.is_usable()
        {
            return Ok(session.channel.clone());
        }
        if let Some(stale) = self.session.take() {
            stale.close().await;
        }
        let session = AmqpSession::open(&self.amqp_url, &self.topology).await?;
        session
            .channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let channel = session.channel.clone();
        self.session = Some(session);
        Ok(channel)
    }

    async fn drain_batch(&mut self) -> Result<BatchOutcome, EnqueueError> {
        let channel = self.channel().await?;
        let topology = &self.topology;
        let config = &self.config;
        let mut conn = self.pool.get().await?;
        let outcome = conn
            .transaction(async |conn| batch_in(conn, &channel, topology, config).await)
            .await?;
        if outcome.error.is_some()
            && let Some(session) = self.session.take()
        {
            session.close().await;
        }
        Ok(outcome)
    }
}

/// The enqueuer's loop state: again at once while there is work, otherwise an idle wait that
/// doubles up to `ENQUEUER_IDLE_MAX_MS`; a failed pass drops the broker session, so the next
/// opens a fresh one.
struct EnqueuerPasses {
    enqueuer: Enqueuer,
    stop: CancellationToken,
    idle: Backoff,
    total: EnqueueSummary,
}

impl Passes for EnqueuerPasses {
    type Error = EnqueueError;
    const WORKER: &'static str = "enqueuer";

    async fn pass(&mut self) -> Result<Next, EnqueueError> {
        match self.enqueuer.run_pass(&self.stop).await {
            Ok(summary) => {
                self.total.add(&summary);
                if summary.published > 0 {
                    tracing::info!(?summary, "enqueuer pass");
                    self.idle.reset();
                    return Ok(Next::Now);
                }
                Ok(Next::After(self.idle.next_delay()))
            }
            Err(error) => {
                if let Some(session) = self.enqueuer.session.take() {
                    session.close().await;
                }
                Err(error)
            }
        }
    }
}
