//! The receipt worker: consumes `ride.receipt` messages with manual acks and mails each rider
//! exactly one receipt per ride.
//!
//! Per delivery:
//! - malformed message, unknown version, unknown ride, or a ride that is not the message's
//!   user's → reject without requeue → dead-letter queue (never retried forever);
//! - otherwise, in one transaction: `INSERT INTO sent_receipts … ON CONFLICT DO NOTHING`. No row
//!   inserted means the receipt was already sent (ack, nothing mailed). A row inserted means
//!   this delivery owns the ride: a concurrent duplicate blocks on the uncommitted primary key
//!   until this transaction ends. The mail is sent with the transaction open, then the
//!   transaction commits, then the delivery is acked;
//! - temporary SMTP failure (4xx, connection refused, timeout) → the transaction rolls back (no
//!   row), and after a back-off delay the delivery is nacked with requeue; the quorum queue's
//!   delivery limit bounds the retries and then dead-letters it;
//! - permanent SMTP failure (5xx, invalid address) → rolled back and dead-lettered.
//!
//! The crash window left: the relay accepted the mail but the commit (or this process) failed
//! before it was recorded. The delivery is then retried and the mail sent again, with the same
//! deterministic Message-ID, so the receiving mail system can drop the duplicate. Sending before
//! recording is the deliberate choice: the other order (record, then send) turns the same crash
//! into a receipt that is never sent, which is worse.

use std::sync::Arc;

use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use futures_util::StreamExt;
use lapin::{
    Channel,
    message::Delivery,
    options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions,
        BasicNackOptions, BasicQosOptions, BasicRejectOptions,
    },
    types::{AMQPValue, FieldTable},
};
use schema::{
    Pool, PoolError,
    models::NewSentReceipt,
    schema::{rides, sent_receipts, users},
};
use serde::Serialize;
use tokio::{sync::Semaphore, task::JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{
    amqp::{self, AmqpSession},
    backoff,
    config::ReceiptsConfig,
    mailer::{MailError, Mailer, Receipt},
    message::ReceiptMessage,
    redact,
    topology::Topology,
};

#[derive(Debug, thiserror::Error)]
pub enum ReceiptError {
    #[error("RabbitMQ error")]
    Broker(#[from] lapin::Error),
}

/// Counts of one pass or of a loop's lifetime.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReceiptSummary {
    pub received: u64,
    /// Mailed and recorded.
    pub sent: u64,
    /// Already sent for this ride: acked without mailing.
    pub duplicates: u64,
    /// Rejected into the dead-letter queue.
    pub dead_lettered: u64,
    /// Requeued after a temporary failure.
    pub retried: u64,
}

impl ReceiptSummary {
    fn count(&mut self, disposition: &Disposition) {
        let mut one = ReceiptSummary::default();
        match disposition {
            Disposition::Sent => one.sent = 1,
            Disposition::Duplicate => one.duplicates = 1,
            Disposition::DeadLetter(_) => one.dead_lettered = 1,
            Disposition::Retry(_) => one.retried = 1,
        }
        crate::metrics::record_receipts(&one);
        self.received += 1;
        match disposition {
            Disposition::Sent => self.sent += 1,
            Disposition::Duplicate => self.duplicates += 1,
            Disposition::DeadLetter(_) => self.dead_lettered += 1,
            Disposition::Retry(_) => self.retried += 1,
        }
    }

    fn add(&mut self, other: &ReceiptSummary) {
        self.received += other.received;
        self.sent += other.sent;
        self.duplicates += other.duplicates;
        self.dead_lettered += other.dead_lettered;
        self.retried += other.retried;
    }
}

/// What to do with a delivery.
#[derive(Debug)]
pub enum Disposition {
    Sent,
    Duplicate,
    DeadLetter(String),
    Retry(String),
}

#[derive(Debug, thiserror::Error)]
enum HandleError {
    #[error("no database connection available")]
    Pool(#[from] PoolError),
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
    #[error("{0}")]
    Mail(#[from] MailError),
}

pub struct ReceiptWorker {
    pool: Pool,
    mailer: Mailer,
    topology: Topology,
    config: ReceiptsConfig,
}

impl ReceiptWorker {
    pub fn new(
        pool: Pool,
        mailer: Mailer,
        topology: Topology,
        config: ReceiptsConfig,
    ) -> Arc<Self> {
        Arc::new(ReceiptWorker {
            pool,
            mailer,
            topology,
            config,
        })
    }

    /// One pass: takes messages with `basic.get` until the queue is empty, settling each. A
    /// temporarily failing message is requeued after its back-off and may come back in the same
    /// pass, until it succeeds or the delivery limit dead-letters it.
    pub async fn run_once(&self, channel: &Channel) -> Result<ReceiptSummary, ReceiptError> {
        let mut summary = ReceiptSummary::default();
        let never = CancellationToken::new();
        while let Some(message) = channel
            .basic_get(
                self.topology.receipts_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?
        {
            let disposition = self.process(&message.delivery, &never).await?;
            summary.count(&disposition);
        }
        Ok(summary)
    }

    /// Consumes until `shutdown` is cancelled, reconnecting with back-off when the connection is
    /// lost (unacked deliveries return to the queue with the connection). On shutdown the
    /// consumer is cancelled first, then in-flight deliveries finish and are settled.
    pub async fn run(
        self: Arc<Self>,
        amqp_url: &str,
        shutdown: CancellationToken,
    ) -> ReceiptSummary {
        let mut total = ReceiptSummary::default();
        while !shutdown.is_cancelled() {
            let Some(session) =
                amqp::connect_with_backoff(amqp_url, &self.topology, &shutdown).await
            else {
                break;
            };
            match Arc::clone(&self).consume(&session, &shutdown).await {
                Ok(summary) => total.add(&summary),
                Err(error) => tracing::warn!(%error, "receipt consumer stopped, reconnecting"),
            }
            session.close().await;
        }
        total
    }

    async fn consume(
        self: Arc<Self>,
        session: &AmqpSession,
        shutdown: &CancellationToken,
    ) -> Result<ReceiptSummary, ReceiptError> {
        let channel = &session.channel;
        channel
            .basic_qos(self.config.prefetch, BasicQosOptions::default())
            .await?;
        let mut consumer = channel
            .basic_consume(
                self.topology.receipts_queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let in_flight = Arc::new(Semaphore::new(usize::from(self.config.prefetch)));
        let mut tasks: JoinSet<Result<Disposition, ReceiptError>> = JoinSet::new();
        let mut summary = ReceiptSummary::default();
        let mut result = Ok(());
        loop {
            // Reap finished tasks as we go so the set does not grow.
            while let Some(done) = tasks.try_join_next() {
                record(&mut summary, done, &mut result);
            }
            let next = tokio::select! {
                () = shutdown.cancelled() => break,
                next = consumer.next() => next,
            };
            let delivery = match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(error)) => {
                    result = Err(error.into());
                    break;
                }
                None => break,
            };
            let permit = match Arc::clone(&in_flight).acquire_owned().await {
                Ok(permit) => permit,
                Err(_) => break,
            };
            let worker = Arc::clone(&self);
            let shutdown = shutdown.clone();
            tasks.spawn(async move {
                let disposition = worker.process(&delivery, &shutdown).await;
                drop(permit);
                disposition
            });
        }
        // Stop receiving first, then let in-flight deliveries finish and be settled.
        let _ = channel
            .basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await;
        while let Some(done) = tasks.join_next().await {
            record(&mut summary, done, &mut result);
        }
        result.map(|()| summary)
    }

    /// Handles one delivery and settles it with the broker.
    async fn process(
        &self,
        delivery: &Delivery,
        shutdown: &CancellationToken,
    ) -> Result<Disposition, ReceiptError> {
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
            .unwrap_or_default();
        let span = tracing::info_span!(
            "process",
            otel.name = %format_args!("{} process", self.topology.receipts_queue),
            otel.kind = "consumer",
            messaging.system = "rabbitmq",
            messaging.operation.type = "process",
            messaging.destination.name = %self.topology.receipts_queue,
            messaging.message.id = %message_id,
            trace_id = tracing::field::Empty,
        );
        let carrier = trace_headers(delivery);
        // The receipt continues the ride's trace, and links to the publish that delivered it.
        telemetry::continue_trace(&span, &telemetry::MapExtractor(&carrier));
        let producer = telemetry::extract(&telemetry::MapExtractor(&carrier));
        {
            use opentelemetry::trace::TraceContextExt;
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            span.add_link(producer.span().span_context().clone());
        }
        let disposition = self
            .handle(&delivery.data, &message_id)
            .instrument(span)
            .await;
        match &disposition {
            Disposition::Sent | Disposition::Duplicate => {
                delivery.acker.ack(BasicAckOptions::default()).await?;
            }
            Disposition::DeadLetter(reason) => {
                tracing::warn!(message_id, reason, "dead-lettering receipt message");
                delivery
                    .acker
                    .reject(BasicRejectOptions { requeue: false })
                    .await?;
            }
            Disposition::Retry(reason) => {
                let deliveries = delivery_count(delivery);
                let delay = backoff::exponential(
                    self.config.retry_base_delay,
                    deliveries,
                    self.config.retry_max_delay,
                );
                tracing::warn!(
                    message_id,
                    reason,
                    deliveries,
                    ?delay,
                    "receipt failed temporarily, requeueing"
                );
                // On shutdown requeue at once: another worker takes it.
                crate::shutdown::sleep(shutdown, delay).await;
                delivery
                    .acker
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await?;
            }
        }
        Ok(disposition)
    }

    /// Decides a delivery's fate, sending the mail if it is due.
    pub async fn handle(&self, body: &[u8], message_id: &str) -> Disposition {
        let message = match ReceiptMessage::decode(body) {
            Ok(message) => message,
            Err(error) => return Disposition::DeadLetter(error.to_string()),
        };
        match self.send_once(&message, message_id).await {
            Ok(disposition) => disposition,
            Err(HandleError::Mail(MailError::Permanent(error))) => Disposition::DeadLetter(error),
            Err(error) => Disposition::Retry(error.to_string()),
        }
    }

    async fn send_once(
        &self,
        message: &ReceiptMessage,
        message_id: &str,
    ) -> Result<Disposition, HandleError> {
        let mut conn = self.pool.get().await?;
        let mailer = &self.mailer;
        let outcome = conn
            .transaction(async |conn| send_in(conn, mailer, message, message_id).await)
            .await;
        match outcome {
            Ok(disposition) => Ok(disposition),
            // Dead-lettering decisions are made inside and must roll back too (nothing written).
            Err(SendInError::Decided(disposition)) => Ok(disposition),
            Err(SendInError::Failed(error)) => Err(error),
        }
    }
}

/// Errors that abort the transaction. `Decided` carries a disposition that needs a rollback.
#[derive(Debug)]
enum SendInError {
    Decided(Disposition),
    Failed(HandleError),
}

impl From<diesel::result::Error> for SendInError {
    fn from(error: diesel::result::Error) -> Self {
        SendInError::Failed(error.into())
    }
}

async fn send_in(
    conn: &mut AsyncPgConnection,
    mailer: &Mailer,
    message: &ReceiptMessage,
    message_id: &str,
) -> Result<Disposition, SendInError> {
    let ride = rides::table
        .inner_join(users::table)
        .filter(rides::id.eq(message.ride_id))
        .select((
            rides::user_id,
            rides::amount,
            rides::currency,
            rides::stripe_charge_id,
            rides::created_at,
            users::email,
        ))
        .first::<(
            i64,
            i64,
            String,
            Option<String>,
            chrono::DateTime<chrono::Utc>,
            String,
        )>(conn)
        .await
        .optional()?;
    let Some((user_id, amount, currency, charge_id, created_at, email)) = ride else {
        return Err(SendInError::Decided(Disposition::DeadLetter(format!(
            "unknown ride {}",
            message.ride_id
        ))));
    };
    if user_id != message.user_id {
        return Err(SendInError::Decided(Disposition::DeadLetter(format!(
            "ride {} does not belong to user {}",
            message.ride_id, message.user_id
        ))));
    }
    let inserted = diesel::insert_into(sent_receipts::table)
        .values(NewSentReceipt {
            ride_id: message.ride_id,
            message_id,
        })
        .on_conflict_do_nothing()
        .execute(conn)
        .await?;
    if inserted == 0 {
        tracing::info!(
            ride_id = message.ride_id,
            message_id,
            "receipt already sent"
        );
        return Ok(Disposition::Duplicate);
    }
    let receipt = Receipt {
        ride_id: message.ride_id,
        to: email,
        // The ride row is authoritative; the message only names the ride.
        amount,
        currency,
        charge_id: charge_id.unwrap_or_else(|| message.charge_id.clone()),
        ride_created_at: created_at,
    };
    mailer
        .send(&receipt)
        .await
        .map_err(|error| SendInError::Failed(error.into()))?;
    tracing::info!(
        ride_id = message.ride_id,
        to = %redact::email(&receipt.to),
        "receipt sent"
    );
    Ok(Disposition::Sent)
}

fn record(
    summary: &mut ReceiptSummary,
    done: Result<Result<Disposition, ReceiptError>, tokio::task::JoinError>,
    result: &mut Result<(), ReceiptError>,
) {
    match done {
        Ok(Ok(disposition)) => summary.count(&disposition),
        Ok(Err(error)) => {
            // Settling failed: the connection is gone and the broker requeues the delivery.
            tracing::warn!(%error, "could not settle a delivery");
            if result.is_ok() {
                *result = Err(error);
            }
        }
        Err(error) => tracing::error!(%error, "receipt task failed"),
    }
}

/// The W3C trace context (`traceparent`, `tracestate`) in a delivery's headers.
fn trace_headers(delivery: &Delivery) -> std::collections::HashMap<String, String> {
    let mut carrier = std::collections::HashMap::new();
    if let Some(headers) = delivery.properties.headers() {
        for name in ["traceparent", "tracestate"] {
            if let Some(AMQPValue::LongString(value)) = headers.inner().get(name) {
                carrier.insert(name.to_owned(), value.to_string());
            }
        }
    }
    carrier
}

/// How often the quorum queue has delivered this message before (`x-delivery-count`).
fn delivery_count(delivery: &Delivery) -> u32 {
    delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get("x-delivery-count").cloned())
        .and_then(|value| match value {
            AMQPValue::LongLongInt(n) => u32::try_from(n).ok(),
            AMQPValue::LongInt(n) => u32::try_from(n).ok(),
            AMQPValue::ShortInt(n) => u32::try_from(n).ok(),
            AMQPValue::LongUInt(n) => Some(n),
            _ => None,
        })
        .unwrap_or(0)
}
