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

use diesel::{
    BoolExpressionMethods, ExpressionMethods, QueryDsl, SelectableHelper,
    sql_types::{Array, BigInt, Bool, Double, Integer, Text},
};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use lapin::{
    BasicProperties, Channel, Confirmation,
    options::{BasicPublishOptions, ConfirmSelectOptions},
    types::{AMQPValue, FieldTable, LongString, ShortString},
};
use schema::{Pool, PoolError, models::StagedJob, schema::staged_jobs};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{
    amqp::AmqpSession,
    backoff::{Backoff, exponential},
    config::EnqueuerConfig,
    metrics::{self, Handled},
    topology::Topology,
    worker_loop::{self, Next, Passes},
};

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
        let exchange = self.topology.exchange.clone();
        let config = &self.config;
        let mut conn = self.pool.get().await?;
        let outcome = conn
            .transaction(async |conn| batch_in(conn, &channel, &exchange, config).await)
            .await?;
        if outcome.error.is_some()
            && let Some(session) = self.session.take()
        {
            session.close().await;
        }
        Ok(outcome)
    }
}

/// One batch inside its transaction: select and lock the due jobs, publish, delete what was
/// confirmed and set aside what came back.
async fn batch_in(
    conn: &mut AsyncPgConnection,
    channel: &Channel,
    exchange: &str,
    config: &EnqueuerConfig,
) -> Result<BatchOutcome, EnqueueError> {
    let jobs: Vec<StagedJob> = staged_jobs::table
        .filter(staged_jobs::parked_at.is_null())
        .filter(
            staged_jobs::next_attempt_at
                .is_null()
                .or(staged_jobs::next_attempt_at.le(diesel::dsl::now)),
        )
        .order(staged_jobs::id)
        .limit(config.batch_size)
        .for_update()
        .skip_locked()
        .select(StagedJob::as_select())
        .load(conn)
        .await?;
    let selected = jobs.len();
    if jobs.is_empty() {
        return Ok(BatchOutcome {
            selected,
            summary: EnqueueSummary::default(),
            error: None,
        });
    }
    let published = publish_all(channel, exchange, &jobs, config.confirm_timeout).await;
    if !published.confirmed.is_empty() {
        diesel::delete(staged_jobs::table.filter(staged_jobs::id.eq_any(&published.confirmed)))
            .execute(conn)
            .await?;
    }
    let parked = set_aside(conn, &jobs, &published.refused, config).await?;
    let refused = published.refused.len() as u64;
    Ok(BatchOutcome {
        selected,
        summary: EnqueueSummary {
            batches: 1,
            published: published.confirmed.len() as u64,
            returned: published.returned,
            nacked: published.nacked,
            set_aside: refused - parked,
            parked,
        },
        error: published.error,
    })
}

/// Gives every returned or nacked job of the batch its next attempt time, or parks it once it
/// has had `max_attempts`, in one statement. Returns how many were parked.
async fn set_aside(
    conn: &mut AsyncPgConnection,
    jobs: &[StagedJob],
    refused: &[(i64, String)],
    config: &EnqueuerConfig,
) -> Result<u64, EnqueueError> {
    if refused.is_empty() {
        return Ok(0);
    }
    let mut ids = Vec::with_capacity(refused.len());
    let mut attempts = Vec::with_capacity(refused.len());
    let mut delays = Vec::with_capacity(refused.len());
    let mut park = Vec::with_capacity(refused.len());
    let mut errors = Vec::with_capacity(refused.len());
    for (id, error) in refused {
        let before = jobs
            .iter()
            .find(|job| job.id == *id)
            .map_or(0, |job| job.attempts);
        let now = before.saturating_add(1);
        let exponent = u32::try_from(now - 1).unwrap_or(0);
        ids.push(*id);
        attempts.push(now);
        delays.push(exponential(config.backoff_base, exponent, config.backoff_max).as_secs_f64());
        park.push(now >= config.max_attempts);
        errors.push(error.chars().take(2000).collect::<String>());
    }
    diesel::sql_query(
        "UPDATE staged_jobs AS job SET attempts = refused.attempts, \
         next_attempt_at = CASE WHEN refused.park THEN NULL \
             ELSE now() + make_interval(secs => refused.delay) END, \
         parked_at = CASE WHEN refused.park THEN now() END, \
         last_error = refused.error \
         FROM unnest($1, $2, $3, $4, $5) AS refused(id, attempts, delay, park, error) \
         WHERE job.id = refused.id",
    )
    .bind::<Array<BigInt>, _>(&ids)
    .bind::<Array<Integer>, _>(&attempts)
    .bind::<Array<Double>, _>(&delays)
    .bind::<Array<Bool>, _>(&park)
    .bind::<Array<Text>, _>(&errors)
    .execute(conn)
    .await?;
    let parked = park.iter().filter(|parked| **parked).count() as u64;
    if parked > 0 {
        tracing::error!(
            parked,
            max_attempts = config.max_attempts,
            "staged jobs parked for a human after every attempt came back"
        );
    }
    Ok(parked)
}

struct Published {
    confirmed: Vec<i64>,
    /// Returned or nacked, with why: these are set aside.
    refused: Vec<(i64, String)>,
    returned: u64,
    nacked: u64,
    error: Option<EnqueueError>,
}

/// Publishes every job, then collects the confirms. Publishing all before awaiting any keeps
/// the batch pipelined (one round trip, not one per job).
async fn publish_all(
    channel: &Channel,
    exchange: &str,
    jobs: &[StagedJob],
    confirm_timeout: Duration,
) -> Published {
    let mut published = Published {
        confirmed: Vec::with_capacity(jobs.len()),
        refused: Vec::new(),
        returned: 0,
        nacked: 0,
        error: None,
    };
    let mut pending = Vec::with_capacity(jobs.len());
    for job in jobs {
        let (routing_key, body) = encode(job);
        let result = channel
            .basic_publish(
                exchange.into(),
                routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &body,
                properties(job, exchange),
            )
            .await;
        match result {
            Ok(confirm) => pending.push((job.id, confirm)),
            Err(error) => {
                published.error = Some(error.into());
                break;
            }
        }
    }
    let deadline = tokio::time::Instant::now() + confirm_timeout;
    for (job_id, confirm) in pending {
        match tokio::time::timeout_at(deadline, confirm).await {
            // Routed to at least one queue and accepted: the only case that deletes the job.
            Ok(Ok(Confirmation::Ack(None))) => published.confirmed.push(job_id),
            Ok(Ok(Confirmation::Ack(Some(returned)))) => {
                published.returned += 1;
                tracing::warn!(
                    job_id,
                    reply_code = returned.reply_code,
                    reply_text = %returned.reply_text,
                    "job returned as unroutable; it stays staged, set aside"
                );
                let reason = format!("returned {} {}", returned.reply_code, returned.reply_text);
                published.refused.push((job_id, reason));
            }
            Ok(Ok(Confirmation::Nack(_))) => {
                published.nacked += 1;
                tracing::warn!(job_id, "broker refused job; it stays staged, set aside");
                published
                    .refused
                    .push((job_id, "nacked by the broker".to_owned()));
            }
            Ok(Ok(Confirmation::NotRequested)) => {
                // Cannot happen on a confirm-mode channel; without a confirm nothing is known.
                published.nacked += 1;
                tracing::error!(
                    job_id,
                    "publish was not confirmed; it stays staged, set aside"
                );
                published.refused.push((job_id, "not confirmed".to_owned()));
            }
            Ok(Err(error)) => {
                if published.error.is_none() {
                    published.error = Some(error.into());
                }
            }
            Err(_) => {
                if published.error.is_none() {
                    published.error = Some(EnqueueError::ConfirmTimeout(confirm_timeout));
                }
            }
        }
    }
    published
}

/// The routing key and body of a job, by the job registry ([`crate::jobs`]). Args that do not
/// fit their type's message are published as they are, so that the consumer rejects them into the
/// dead-letter queue where a person sees them, instead of blocking the drain. Unknown job names
/// are routed by name: with no queue bound they are returned and set aside.
fn encode(job: &StagedJob) -> (String, Vec<u8>) {
    let raw = || job.job_args.to_string().into_bytes();
    let Some(kind) = crate::jobs::find(&job.job_name) else {
        return (job.job_name.clone(), raw());
    };
    let body = (kind.encode)(&job.job_args).unwrap_or_else(|| {
        tracing::error!(
            job_id = job.id,
            job_name = kind.job_name,
            "job args do not fit the message contract"
        );
        raw()
    });
    (kind.routing_key.to_owned(), body)
}

/// The message's properties. Its headers carry the trace context of a `publish` span that
/// continues the trace the job was staged under, so the consumer's span joins the same trace.
fn properties(job: &StagedJob, exchange: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("x-job-name"),
        AMQPValue::LongString(LongString::from(job.job_name.as_str())),
    );
    let staged_under: std::collections::HashMap<String, String> = job
        .trace_context
        .as_object()
        .map(|context| {
            context
                .iter()
                .filter_map(|(name, value)| Some((name.clone(), value.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    let span = tracing::info_span!(
        "publish",
        otel.name = %format_args!("{exchange} publish"),
        otel.kind = "producer",
        messaging.system = "rabbitmq",
        messaging.operation.type = "send",
        messaging.destination.name = exchange,
        messaging.message.id = job.id,
        trace_id = tracing::field::Empty,
    );
    telemetry::continue_trace(&span, &telemetry::MapExtractor(&staged_under));
    let mut carried = span.in_scope(telemetry::inject_current);
    if !carried.contains_key("traceparent") {
        // No OpenTelemetry layer is installed (a library user, a test): pass the staged context
        // on unchanged rather than drop it.
        carried = staged_under
            .into_iter()
            .filter(|(name, _)| name == "traceparent" || name == "tracestate")
            .collect();
    }
    for (name, value) in carried {
        headers.insert(
            ShortString::from(name.as_str()),
            AMQPValue::LongString(LongString::from(value.as_str())),
        );
    }
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(job.id.to_string().into())
        .with_timestamp(u64::try_from(job.created_at.timestamp()).unwrap_or(0))
        .with_headers(headers)
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
