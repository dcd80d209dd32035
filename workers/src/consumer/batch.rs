//! One batch of deliveries: each decoded in its own `process` span, the decoded ones run by the
//! handler together, and every delivery settled as its outcome says.

use std::collections::HashMap;

use contract::BackgroundJob;
use lapin::{
    message::Delivery,
    options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions},
    types::AMQPValue,
};
use telemetry::semconv::{self, attribute};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{
    ConsumeError, Delivered, JobConsumer, JobHandler, Settle, Settlement, stream::SETTLE_TIMEOUT,
};
use crate::{backoff, metrics};

impl<H: JobHandler> JobConsumer<H> {
    /// Runs a batch and settles each delivery; one result per delivery, in order.
    pub(super) async fn process(
        &self,
        deliveries: Vec<Delivery>,
        shutdown: &CancellationToken,
    ) -> Vec<Result<H::Outcome, ConsumeError>> {
        let opened: Vec<(String, tracing::Span)> = deliveries
            .iter()
            .map(|delivery| self.open(delivery))
            .collect();
        let mut outcomes: Vec<Option<H::Outcome>> = Vec::with_capacity(deliveries.len());
        let mut jobs = Vec::with_capacity(deliveries.len());
        for (delivery, (message_id, span)) in deliveries.iter().zip(&opened) {
            match H::Job::from_message(&delivery.data) {
                Ok(job) => {
                    outcomes.push(None);
                    jobs.push(Delivered {
                        job,
                        message_id: message_id.clone(),
                        span: span.clone(),
                    });
                }
                Err(error) => outcomes.push(Some(H::Outcome::undecodable(error.to_string()))),
            }
        }
        let mut ran = self.handler.run_batch(jobs, shutdown).await.into_iter();
        let outcomes = outcomes.into_iter().map(|decided| {
            decided.or_else(|| ran.next()).unwrap_or_else(|| {
                tracing::error!(
                    queue = self.queue,
                    "the handler returned no outcome for a job"
                );
                H::Outcome::unanswered()
            })
        });
        let settles = deliveries.iter().zip(opened).zip(outcomes).map(
            |((delivery, (message_id, span)), outcome)| async move {
                self.settle(delivery, &message_id, &outcome, shutdown)
                    .instrument(span)
                    .await
                    .map(|()| outcome)
            },
        );
        futures_util::future::join_all(settles).await
    }

    /// The delivery's message id and its `process` span: it continues the trace the job was
    /// staged under and links to the publish that delivered it. RabbitMQ's conventions name the
    /// exchange the message was published to as the destination, with its routing key; the queue
    /// it was taken from is this project's `rides.queue`.
    fn open(&self, delivery: &Delivery) -> (String, tracing::Span) {
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
            .unwrap_or_default();
        let exchange = delivery.exchange.as_str();
        let span = tracing::info_span!(
            "process",
            otel.name = %semconv::messaging_span_name(semconv::RABBITMQ_PROCESS, exchange),
            otel.kind = "consumer",
            { attribute::MESSAGING_SYSTEM } = semconv::MESSAGING_SYSTEM_RABBITMQ,
            { attribute::MESSAGING_OPERATION_NAME } = semconv::RABBITMQ_PROCESS,
            { attribute::MESSAGING_OPERATION_TYPE } = semconv::MESSAGING_OPERATION_PROCESS,
            { attribute::MESSAGING_DESTINATION_NAME } = exchange,
            { attribute::MESSAGING_RABBITMQ_DESTINATION_ROUTING_KEY } = delivery.routing_key.as_str(),
            { attribute::MESSAGING_RABBITMQ_MESSAGE_DELIVERY_TAG } =
                i64::try_from(delivery.delivery_tag).unwrap_or(i64::MAX),
            { attribute::MESSAGING_MESSAGE_ID } = %message_id,
            rides.queue = %self.queue,
            trace_id = tracing::field::Empty,
        );
        let carrier = trace_headers(delivery);
        telemetry::continue_trace(&span, &telemetry::MapExtractor(&carrier));
        let producer = telemetry::extract(&telemetry::MapExtractor(&carrier));
        {
            use opentelemetry::trace::TraceContextExt;
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            span.add_link(producer.span().span_context().clone());
        }
        (message_id, span)
    }

    /// Tells the broker what became of the delivery.
    async fn settle(
        &self,
        delivery: &Delivery,
        message_id: &str,
        outcome: &H::Outcome,
        shutdown: &CancellationToken,
    ) -> Result<(), ConsumeError> {
        match outcome.settlement() {
            Settlement::Ack => {
                metrics::count_settled(self.job_name, "ack");
                bounded(delivery.acker.ack(BasicAckOptions::default())).await
            }
            Settlement::DeadLetter(reason) => {
                metrics::count_settled(self.job_name, "dead_letter");
                tracing::warn!(message_id, reason, queue = self.queue, "dead-lettering");
                bounded(delivery.acker.reject(BasicRejectOptions { requeue: false })).await
            }
            Settlement::Retry(reason) => {
                metrics::count_settled(self.job_name, "retry");
                let deliveries = delivery_count(delivery);
                let delay = backoff::exponential(
                    self.settings.retry_base_delay,
                    deliveries,
                    self.settings.retry_max_delay,
                );
                tracing::warn!(
                    message_id,
                    reason,
                    deliveries,
                    ?delay,
                    queue = self.queue,
                    "job failed temporarily, requeueing"
                );
                // On shutdown requeue at once: another worker takes it.
                crate::worker_loop::sleep(shutdown, delay).await;
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                bounded(delivery.acker.nack(requeue)).await
            }
        }
    }
}

/// `settle` bounded by [`SETTLE_TIMEOUT`].
async fn bounded<T>(
    settle: impl std::future::Future<Output = lapin::Result<T>>,
) -> Result<(), ConsumeError> {
    match tokio::time::timeout(SETTLE_TIMEOUT, settle).await {
        Ok(settled) => settled.map(|_| ()).map_err(ConsumeError::from),
        Err(_) => Err(ConsumeError::SettleTimedOut(SETTLE_TIMEOUT)),
    }
}

/// The W3C trace context (`traceparent`, `tracestate`) in a delivery's headers.
fn trace_headers(delivery: &Delivery) -> HashMap<String, String> {
    let mut carrier = HashMap::new();
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
