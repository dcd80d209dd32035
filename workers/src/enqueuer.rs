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

use std::time::Duration;

use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use lapin::{
    BasicProperties, Channel, Confirmation,
    options::{BasicPublishOptions, ConfirmSelectOptions},
    types::{AMQPValue, FieldTable, LongString, ShortString},
};
use schema::{Pool, PoolError, SEND_RIDE_RECEIPT_JOB, models::StagedJob, schema::staged_jobs};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{
    amqp::AmqpSession,
    backoff::Backoff,
    config::EnqueuerConfig,
    message::{ReceiptJobArgs, ReceiptMessage},
    shutdown,
    topology::{RECEIPT_ROUTING_KEY, Topology},
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
}

impl EnqueueSummary {
    fn add(&mut self, other: &EnqueueSummary) {
        self.batches += other.batches;
        self.published += other.published;
        self.returned += other.returned;
        self.nacked += other.nacked;
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

    /// One pass: drains batches until the table is empty or a batch made no progress (every
    /// job returned or nacked, which another batch right away would only repeat). A broker
    /// failure ends the pass with an error after the confirmed part was committed; the next call
    /// reconnects.
    pub async fn run_once(&mut self) -> Result<EnqueueSummary, EnqueueError> {
        let mut total = EnqueueSummary::default();
        loop {
            let outcome = self.drain_batch().await?;
            total.add(&outcome.summary);
            crate::metrics::record_enqueue(&outcome.summary);
            if let Some(error) = outcome.error {
                tracing::warn!(published = total.published, "enqueuer pass interrupted");
                return Err(error);
            }
            let limit = usize::try_from(self.config.batch_size).unwrap_or(usize::MAX);
            if outcome.selected < limit || outcome.summary.published == 0 {
                if let Ok(mut conn) = self.pool.get().await {
                    crate::metrics::observe_backlog(&mut conn).await;
                }
                return Ok(total);
            }
        }
    }

    /// Runs passes until `shutdown` is cancelled. A pass in progress is finished first, so a
    /// batch is never cut between publishing and deleting. An idle enqueuer polls, backing off up
    /// to `idle_max`. (It does not LISTEN: a NOTIFY per staged job would serialise every
    /// CreateRide's commit across the database; see the `drop_staged_jobs_notify` migration.)
    pub async fn run(mut self, shutdown_token: CancellationToken) -> EnqueueSummary {
        let mut total = EnqueueSummary::default();
        let mut idle = Backoff::new(Duration::from_millis(50), self.config.idle_max);
        let mut failing = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        while !shutdown_token.is_cancelled() {
            match self.run_once().await {
                Ok(summary) => {
                    failing.reset();
                    total.add(&summary);
                    if summary.published > 0 {
                        tracing::info!(?summary, "enqueuer pass");
                        idle.reset();
                        continue;
                    }
                    shutdown::sleep(&shutdown_token, idle.next_delay()).await;
                }
                Err(error) => {
                    let delay = failing.next_delay();
                    tracing::error!(error = %telemetry::error_chain(&error), ?delay, "enqueuer pass failed, retrying");
                    if let Some(session) = self.session.take() {
                        session.close().await;
                    }
                    if !shutdown::sleep(&shutdown_token, delay).await {
                        break;
                    }
                }
            }
        }
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        total
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
        let batch_size = self.config.batch_size;
        let exchange = self.topology.exchange.clone();
        let confirm_timeout = self.config.confirm_timeout;
        let mut conn = self.pool.get().await?;
        let outcome = conn
            .transaction(async |conn| {
                batch_in(conn, &channel, &exchange, batch_size, confirm_timeout).await
            })
            .await?;
        if outcome.error.is_some()
            && let Some(session) = self.session.take()
        {
            session.close().await;
        }
        Ok(outcome)
    }
}

/// One batch inside its transaction: select and lock, publish, delete what was confirmed.
async fn batch_in(
    conn: &mut AsyncPgConnection,
    channel: &Channel,
    exchange: &str,
    batch_size: i64,
    confirm_timeout: Duration,
) -> Result<BatchOutcome, EnqueueError> {
    let jobs: Vec<StagedJob> = staged_jobs::table
        .order(staged_jobs::id)
        .limit(batch_size)
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
    let published = publish_all(channel, exchange, &jobs, confirm_timeout).await;
    if !published.confirmed.is_empty() {
        diesel::delete(staged_jobs::table.filter(staged_jobs::id.eq_any(&published.confirmed)))
            .execute(conn)
            .await?;
    }
    Ok(BatchOutcome {
        selected,
        summary: EnqueueSummary {
            batches: 1,
            published: published.confirmed.len() as u64,
            returned: published.returned,
            nacked: published.nacked,
        },
        error: published.error,
    })
}

struct Published {
    confirmed: Vec<i64>,
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
                    "job returned as unroutable; it stays staged"
                );
            }
            Ok(Ok(Confirmation::Nack(_))) => {
                published.nacked += 1;
                tracing::warn!(job_id, "broker refused job; it stays staged");
            }
            Ok(Ok(Confirmation::NotRequested)) => {
                // Cannot happen on a confirm-mode channel; without a confirm nothing is known.
                published.nacked += 1;
                tracing::error!(job_id, "publish was not confirmed; it stays staged");
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

/// The routing key and body of a job. Receipt jobs become the versioned [`ReceiptMessage`].
/// Receipt args that do not fit it are published as they are, so that the consumer rejects them
/// into the dead-letter queue where a human sees them, instead of blocking the drain. Unknown
/// job names are routed by name: with no queue bound they are returned and stay staged.
fn encode(job: &StagedJob) -> (String, Vec<u8>) {
    if job.job_name == SEND_RIDE_RECEIPT_JOB {
        let body = serde_json::from_value::<ReceiptJobArgs>(job.job_args.clone())
            .ok()
            .map(ReceiptMessage::from_job_args)
            .and_then(|message| message.encode().ok());
        match body {
            Some(body) => return (RECEIPT_ROUTING_KEY.to_owned(), body),
            None => {
                tracing::error!(
                    job_id = job.id,
                    "receipt job args do not fit the message contract"
                );
                return (
                    RECEIPT_ROUTING_KEY.to_owned(),
                    job.job_args.to_string().into_bytes(),
                );
            }
        }
    }
    (job.job_name.clone(), job.job_args.to_string().into_bytes())
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
