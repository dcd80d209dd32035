//! The broker side: a pass with `basic.get`, or a consumer that reconnects, each delivery
//! processed in its own task (at most the prefetch at once) and settled as its disposition says.

use std::{sync::Arc, time::Duration};

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
use tokio::{sync::Semaphore, task::JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Disposition, ReceiptError, ReceiptSummary, ReceiptWorker};

/// How long a settle may wait for lapin, and how long the in-flight deliveries of a consumer
/// whose connection is gone may take to finish, before the consumer gives up on them and
/// reconnects. Without these bounds, proof's HA run 40844b0b saw the consumer hang for good after
/// a broker node's reset: no receipt mailed for its last 12 minutes.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a waiting consumer looks at its connection's state.
const LIVENESS_CHECK: Duration = Duration::from_millis(500);

/// Resolves once `session` is no longer usable.
async fn connection_lost(session: &AmqpSession) {
    let mut tick = tokio::time::interval(LIVENESS_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !session.is_usable() {
            return;
        }
    }
}

/// `settle` bounded by [`SETTLE_TIMEOUT`].
async fn bounded<T>(
    settle: impl std::future::Future<Output = lapin::Result<T>>,
) -> Result<T, ReceiptError> {
    match tokio::time::timeout(SETTLE_TIMEOUT, settle).await {
        Ok(settled) => Ok(settled?),
        Err(_) => Err(ReceiptError::SettleTimedOut(SETTLE_TIMEOUT)),
    }
}
use crate::{
    amqp::{self, AmqpSession},
    backoff,
};

impl ReceiptWorker {
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
            // A polite close on a dead connection may never be answered either.
            let _ = tokio::time::timeout(SETTLE_TIMEOUT, session.close()).await;
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
                () = connection_lost(session) => {
                    result = Err(ReceiptError::ConnectionLost);
                    break;
                }
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
            // Every permit may be held by a delivery whose settle hangs on a dead connection.
            let permit = tokio::select! {
                permit = Arc::clone(&in_flight).acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => break,
                },
                () = connection_lost(session) => {
                    result = Err(ReceiptError::ConnectionLost);
                    break;
                }
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
        let _ = bounded(channel.basic_cancel(consumer.tag(), BasicCancelOptions::default())).await;
        let finished = async {
            while let Some(done) = tasks.join_next().await {
                record(&mut summary, done, &mut result);
            }
        };
        // Each task's own steps are bounded (database, SMTP, relay search, settle); this bound is
        // for what is not. Detached, not aborted: a task cut mid-transaction is a crash the
        // claims survive, but one left to finish is cleaner.
        if tokio::time::timeout(SETTLE_TIMEOUT * 3, finished)
            .await
            .is_err()
        {
            tracing::warn!(
                unfinished = tasks.len(),
                "in-flight receipts did not finish; left to finish on their own, their deliveries \
                 return to the queue with the connection"
            );
            tasks.detach_all();
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
                bounded(delivery.acker.ack(BasicAckOptions::default())).await?;
            }
            Disposition::DeadLetter(reason) => {
                tracing::warn!(message_id, reason, "dead-lettering receipt message");
                bounded(delivery.acker.reject(BasicRejectOptions { requeue: false })).await?;
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
                crate::worker_loop::sleep(shutdown, delay).await;
                bounded(delivery.acker.nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                }))
                .await?;
            }
        }
        Ok(disposition)
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
