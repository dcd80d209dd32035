//! The receipt worker: consumes `ride.receipt` messages with manual acks and mails each rider
//! exactly one receipt per ride.
//!
//! Per delivery:
//! - malformed message, unknown version, unknown ride, a ride that is not the message's user's,
//!   or a ride that records no charge or another charge than the message's → reject without
//!   requeue → dead-letter queue with the reason logged (never retried forever, never mailed: a
//!   receipt is only ever for a charge the ride records);
//! - otherwise the attempt *claims* the ride's receipt: a `receipt_claims` row, committed before
//!   any SMTP traffic, holding an attempt count and a lease. While another attempt's lease runs,
//!   this one waits (a duplicate message, or a redelivery after a crash, never sends in parallel);
//! - with the claim held: a ride already in `sent_receipts` is a duplicate (ack, nothing mailed).
//!   If an earlier attempt claimed the ride before (attempts > 1) it may have handed the mail to
//!   the relay and died before recording it, so the relay is asked for the deterministic
//!   Message-ID first (`MAIL_SEARCH_URL`, [`crate::relay_search`]); found → recorded, not re-sent;
//! - then the mail is sent, and one transaction writes `sent_receipts` and deletes the claim,
//!   then the delivery is acked;
//! - temporary SMTP failure (4xx, connection refused, timeout) → the claim's lease is ended at
//!   once (the next attempt need not wait, and will check the relay), and after a back-off delay
//!   the delivery is nacked with requeue; the quorum queue's delivery limit bounds the retries and
//!   then dead-letters it;
//! - permanent SMTP failure (5xx, invalid address) → the claim is dropped (nothing was accepted)
//!   and the delivery dead-lettered.
//!
//! What is left of the crash window: without `MAIL_SEARCH_URL`, a receipt whose attempt died
//! between the relay's `250` and the commit is sent again (same Message-ID, so the receiving mail
//! system can drop it). Sending again is the deliberate choice over never sending. With the
//! search configured, the relay's own record decides.

use std::{sync::Arc, time::Duration};

use contract::message::ReceiptMessage;
use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl, QueryableByName,
    sql_types::{BigInt, Double, Integer, Text},
};
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
    models::{NewSentReceipt, RECORDED_VIA_RELAY_SEARCH, RECORDED_VIA_SMTP},
    schema::{receipt_claims, rides, sent_receipts, users},
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
    metrics::{self, Handled},
    redact,
    relay_search::RelaySearch,
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
    /// An earlier attempt's mail was found at the relay: recorded and acked without mailing.
    pub recovered: u64,
    /// Mailed although an earlier attempt may have mailed it too, because no relay search is
    /// configured to check (also counted in `sent`).
    pub unverified_resends: u64,
    /// Rejected into the dead-letter queue.
    pub dead_lettered: u64,
    /// Requeued after a temporary failure.
    pub retried: u64,
}

impl ReceiptSummary {
    /// Counts this summary in the worker's metric, by outcome.
    pub(crate) fn record(&self) {
        metrics::count(Handled::Receipts, "sent", self.sent);
        metrics::count(Handled::Receipts, "duplicate", self.duplicates);
        metrics::count(Handled::Receipts, "recovered", self.recovered);
        metrics::count(
            Handled::Receipts,
            "unverified_resend",
            self.unverified_resends,
        );
        metrics::count(Handled::Receipts, "dead_lettered", self.dead_lettered);
        metrics::count(Handled::Receipts, "retried", self.retried);
    }
}

impl ReceiptSummary {
    fn count(&mut self, disposition: &Disposition) {
        let mut one = ReceiptSummary {
            received: 1,
            ..ReceiptSummary::default()
        };
        match disposition {
            Disposition::Sent { verified: true } => one.sent = 1,
            Disposition::Sent { verified: false } => {
                one.sent = 1;
                one.unverified_resends = 1;
            }
            Disposition::Duplicate => one.duplicates = 1,
            Disposition::Recovered => one.recovered = 1,
            Disposition::DeadLetter(_) => one.dead_lettered = 1,
            Disposition::Retry(_) => one.retried = 1,
        }
        one.record();
        self.add(&one);
    }

    fn add(&mut self, other: &ReceiptSummary) {
        self.received += other.received;
        self.sent += other.sent;
        self.duplicates += other.duplicates;
        self.recovered += other.recovered;
        self.unverified_resends += other.unverified_resends;
        self.dead_lettered += other.dead_lettered;
        self.retried += other.retried;
    }
}

/// What to do with a delivery.
#[derive(Debug)]
pub enum Disposition {
    /// Mailed and recorded. `verified: false` when an earlier attempt may have mailed it too and
    /// no relay search could say.
    Sent {
        verified: bool,
    },
    Duplicate,
    Recovered,
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
    relay_search: Option<RelaySearch>,
    topology: Topology,
    config: ReceiptsConfig,
}

impl ReceiptWorker {
    pub fn new(
        pool: Pool,
        mailer: Mailer,
        relay_search: Option<RelaySearch>,
        topology: Topology,
        config: ReceiptsConfig,
    ) -> Arc<Self> {
        Arc::new(ReceiptWorker {
            pool,
            mailer,
            relay_search,
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
            .handle(&delivery.data, &message_id, shutdown)
            .instrument(span)
            .await;
        match &disposition {
            Disposition::Sent { .. } | Disposition::Duplicate | Disposition::Recovered => {
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
    pub async fn handle(
        &self,
        body: &[u8],
        message_id: &str,
        shutdown: &CancellationToken,
    ) -> Disposition {
        let message = match ReceiptMessage::decode(body) {
            Ok(message) => message,
            Err(error) => return Disposition::DeadLetter(error.to_string()),
        };
        match self.send_once(&message, message_id, shutdown).await {
            Ok(disposition) => disposition,
            Err(HandleError::Mail(MailError::Permanent(error))) => Disposition::DeadLetter(error),
            Err(error) => Disposition::Retry(error.to_string()),
        }
    }

    async fn send_once(
        &self,
        message: &ReceiptMessage,
        message_id: &str,
        shutdown: &CancellationToken,
    ) -> Result<Disposition, HandleError> {
        let receipt = match self.receipt_for(message).await? {
            Ok(receipt) => receipt,
            Err(dead_letter) => return Ok(dead_letter),
        };
        let ride_id = message.ride_id;
        let Some(claim) = self.claim(ride_id, message_id, shutdown).await? else {
            return Ok(Disposition::Retry(
                "shutting down while another attempt holds the receipt".into(),
            ));
        };
        let mut conn = self.pool.get().await?;
        let already_sent = sent_receipts::table
            .find(ride_id)
            .select(sent_receipts::ride_id)
            .first::<i64>(&mut conn)
            .await
            .optional()?
            .is_some();
        if already_sent {
            claim.delete(&mut conn).await?;
            tracing::info!(ride_id, message_id, "receipt already sent");
            return Ok(Disposition::Duplicate);
        }
        drop(conn);
        let mut verified = true;
        if claim.attempts > 1 {
            // An earlier attempt claimed this receipt and never recorded it: it may have died
            // after the relay accepted the mail. The relay's record decides.
            match &self.relay_search {
                Some(search) => {
                    let held = search
                        .holds(&crate::mailer::receipt_message_id(ride_id))
                        .await;
                    match held {
                        Ok(true) => {
                            let mut conn = self.pool.get().await?;
                            claim
                                .record_sent(&mut conn, RECORDED_VIA_RELAY_SEARCH)
                                .await?;
                            tracing::warn!(
                                ride_id,
                                attempts = claim.attempts,
                                "an earlier attempt's receipt was found at the relay; not sending again"
                            );
                            return Ok(Disposition::Recovered);
                        }
                        Ok(false) => {}
                        Err(error) => {
                            self.end_lease(&claim).await;
                            return Err(HandleError::Mail(MailError::Temporary(
                                telemetry::error_chain(&error),
                            )));
                        }
                    }
                }
                None => {
                    verified = false;
                    tracing::warn!(
                        ride_id,
                        attempts = claim.attempts,
                        "an earlier attempt may have sent this receipt and MAIL_SEARCH_URL is \
                         unset, so it cannot be checked: sending again with the same Message-ID"
                    );
                }
            }
        }
        let sent = match tokio::time::timeout(self.config.smtp_timeout, self.mailer.send(&receipt))
            .await
        {
            Ok(sent) => sent,
            Err(_) => Err(MailError::Unconfirmed(
                "the SMTP conversation timed out".into(),
            )),
        };
        if let Err(error) = sent {
            match &error {
                // Refused outright: nothing reached the relay and the message leaves the queue.
                MailError::Permanent(_) => {
                    if let Ok(mut conn) = self.pool.get().await {
                        let _ = claim.delete(&mut conn).await;
                    }
                }
                MailError::Temporary(_) => self.end_lease(&claim).await,
                // The relay may still be finishing the conversation this attempt left, and keep
                // the mail. The lease (longer than a conversation) is left to run out, so that
                // the retry asks the relay's search only after that: asked at once, it found
                // nothing and sent a second copy (long campaign 40d06df2, two rides).
                MailError::Unconfirmed(_) => {}
            }
            return Err(error.into());
        }
        let mut conn = self.pool.get().await?;
        claim.record_sent(&mut conn, RECORDED_VIA_SMTP).await?;
        tracing::info!(
            ride_id,
            to = %redact::email(&receipt.to),
            "receipt sent"
        );
        Ok(Disposition::Sent { verified })
    }

    /// The receipt for the message's ride, or the dead-letter disposition when the message names
    /// a ride that does not exist, is not its user's, or does not record the message's charge.
    async fn receipt_for(
        &self,
        message: &ReceiptMessage,
    ) -> Result<Result<Receipt, Disposition>, HandleError> {
        let mut conn = self.pool.get().await?;
        let ride = rides::table
            .inner_join(users::table)
            .filter(rides::id.eq(message.ride_id))
            .filter(rides::user_id.eq(message.user_id))
            .select((
                rides::amount,
                rides::currency,
                rides::stripe_charge_id,
                rides::created_at,
                users::email,
            ))
            .first::<(
                i64,
                String,
                Option<String>,
                chrono::DateTime<chrono::Utc>,
                String,
            )>(&mut conn)
            .await
            .optional()?;
        let Some((amount, currency, charge_id, created_at, email)) = ride else {
            return Ok(Err(Disposition::DeadLetter(format!(
                "unknown ride {} of user {}",
                message.ride_id, message.user_id
            ))));
        };
        // The ride row is authoritative; the message only names the ride. A ride that records no
        // charge was not paid (a charge never recorded, or refunded); one that records another
        // charge than the message's is not what the message was staged for.
        let Some(charge_id) = charge_id else {
            return Ok(Err(Disposition::DeadLetter(format!(
                "ride {} records no charge (the message names {})",
                message.ride_id, message.charge_id
            ))));
        };
        if charge_id != message.charge_id {
            return Ok(Err(Disposition::DeadLetter(format!(
                "ride {} records charge {charge_id}, not the message's {}",
                message.ride_id, message.charge_id
            ))));
        }
        Ok(Ok(Receipt {
            ride_id: message.ride_id,
            to: email,
            amount,
            currency,
            charge_id,
            ride_created_at: created_at,
        }))
    }

    /// Claims the ride's receipt, waiting out another attempt's lease. `None` if shutdown came
    /// first.
    async fn claim(
        &self,
        ride_id: i64,
        message_id: &str,
        shutdown: &CancellationToken,
    ) -> Result<Option<Claim>, HandleError> {
        loop {
            let wait = {
                let mut conn = self.pool.get().await?;
                match Claim::take(&mut conn, ride_id, message_id, self.config.claim_lease).await? {
                    Ok(claim) => return Ok(Some(claim)),
                    Err(wait) => wait,
                }
            };
            if shutdown.is_cancelled() {
                return Ok(None);
            }
            tracing::info!(
                ride_id,
                ?wait,
                "another attempt holds this receipt; waiting for it"
            );
            // A little past the lease's end, so the claim has lapsed when we look again.
            crate::shutdown::sleep(
                shutdown,
                wait.min(self.config.claim_lease) + Duration::from_millis(20),
            )
            .await;
        }
    }

    /// Best effort: a lease that is not ended here simply runs out.
    async fn end_lease(&self, claim: &Claim) {
        if let Ok(mut conn) = self.pool.get().await
            && let Err(error) = claim.end_lease(&mut conn).await
        {
            tracing::warn!(error = %error, ride_id = claim.ride_id, "could not end a receipt claim's lease");
        }
    }
}

/// One attempt's claim on a ride's receipt. `attempts` is its fencing token: a later attempt
/// that took the claim over has a higher count, and this one can no longer record or drop it.
#[derive(Debug)]
struct Claim {
    ride_id: i64,
    message_id: String,
    attempts: i32,
}

#[derive(QueryableByName)]
struct Attempts {
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

#[derive(QueryableByName)]
struct Remaining {
    #[diesel(sql_type = Double)]
    secs: f64,
}

impl Claim {
    /// Takes the claim if nobody holds it or its holder's lease ran out; otherwise returns how
    /// long that lease still runs. Autocommit: the claim must be durable before any mail leaves.
    async fn take(
        conn: &mut AsyncPgConnection,
        ride_id: i64,
        message_id: &str,
        lease: Duration,
    ) -> Result<Result<Claim, Duration>, diesel::result::Error> {
        let taken = diesel::sql_query(
            "INSERT INTO receipt_claims (ride_id, message_id, claimed_until) \
             VALUES ($1, $2, now() + make_interval(secs => $3)) \
             ON CONFLICT (ride_id) DO UPDATE \
                SET attempts = receipt_claims.attempts + 1, \
                    claimed_until = EXCLUDED.claimed_until, \
                    message_id = EXCLUDED.message_id \
              WHERE receipt_claims.claimed_until <= now() \
             RETURNING attempts",
        )
        .bind::<BigInt, _>(ride_id)
        .bind::<Text, _>(message_id)
        .bind::<Double, _>(lease.as_secs_f64())
        .get_result::<Attempts>(conn)
        .await
        .optional()?;
        if let Some(Attempts { attempts }) = taken {
            return Ok(Ok(Claim {
                ride_id,
                message_id: message_id.to_owned(),
                attempts,
            }));
        }
        let remaining = diesel::sql_query(
            "SELECT GREATEST(EXTRACT(EPOCH FROM claimed_until - now()), 0)::float8 AS secs \
               FROM receipt_claims WHERE ride_id = $1",
        )
        .bind::<BigInt, _>(ride_id)
        .get_result::<Remaining>(conn)
        .await
        .optional()?;
        // No row: the holder finished between the two statements; look again at once.
        let secs = remaining.map_or(0.0, |r| r.secs);
        Ok(Err(
            Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO)
        ))
    }

    /// Records the receipt as sent and releases the claim, in one transaction.
    async fn record_sent(
        &self,
        conn: &mut AsyncPgConnection,
        recorded_via: &str,
    ) -> Result<(), diesel::result::Error> {
        let released = conn
            .transaction(async |conn| {
                diesel::insert_into(sent_receipts::table)
                    .values(NewSentReceipt {
                        ride_id: self.ride_id,
                        message_id: &self.message_id,
                        recorded_via,
                    })
                    .on_conflict_do_nothing()
                    .execute(conn)
                    .await?;
                self.delete(conn).await
            })
            .await?;
        if !released {
            // Only possible if a send outlived the lease, which the configuration check
            // (lease > SMTP timeout) and the send's own timeout rule out.
            tracing::error!(
                ride_id = self.ride_id,
                "a receipt claim was taken over while its mail was being sent; the rider may get it twice"
            );
        }
        Ok(())
    }

    /// Deletes the claim if it is still this attempt's; also how a claim is dropped without a
    /// send (a duplicate, or a relay that refused the mail). True if it was still ours.
    async fn delete(&self, conn: &mut AsyncPgConnection) -> Result<bool, diesel::result::Error> {
        let deleted = diesel::delete(
            receipt_claims::table
                .filter(receipt_claims::ride_id.eq(self.ride_id))
                .filter(receipt_claims::attempts.eq(self.attempts)),
        )
        .execute(conn)
        .await?;
        Ok(deleted == 1)
    }

    /// Ends the lease now, keeping the attempt count, so the next attempt starts at once and
    /// checks the relay first.
    async fn end_lease(&self, conn: &mut AsyncPgConnection) -> Result<(), diesel::result::Error> {
        diesel::update(
            receipt_claims::table
                .filter(receipt_claims::ride_id.eq(self.ride_id))
                .filter(receipt_claims::attempts.eq(self.attempts)),
        )
        .set(receipt_claims::claimed_until.eq(diesel::dsl::now))
        .execute(conn)
        .await
        .map(|_| ())
    }
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
