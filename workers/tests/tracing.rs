//! The trace of a ride continues through the queue: the enqueuer's publish span is a child of the
//! context the job was staged under, its context travels in the AMQP headers, and the receipt
//! worker's process span continues it and links to the publish. Spans are captured in memory
//! (this file is its own test process, since the capturing subscriber is global).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "fleet/common.rs"]
#[allow(dead_code)]
mod common;

use api_server::testing::{GOOD_CARD, TestApp, authed, new_key, ride_request};
use common::TestBroker;
use telemetry::testing::{CapturedSpans, SpanData};

const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a opentelemetry::Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

/// RabbitMQ's messaging conventions, as the specification spells them: `{operation} {exchange}`
/// span names, the exchange as the destination on both sides, the routing key, and the delivery
/// tag where a delivery has one.
fn assert_messaging_attributes(publish: &SpanData, process: &SpanData, exchange: &str) {
    use opentelemetry::Value;
    assert_eq!(publish.name, format!("publish {exchange}"));
    assert_eq!(process.name, format!("process {exchange}"));
    for (span, operation, kind) in [
        (publish, "publish", "send"),
        (process, "process", "process"),
    ] {
        assert_eq!(
            attribute(span, "messaging.system"),
            Some(&Value::from("rabbitmq"))
        );
        assert_eq!(
            attribute(span, "messaging.operation.name"),
            Some(&Value::from(operation))
        );
        assert_eq!(
            attribute(span, "messaging.operation.type"),
            Some(&Value::from(kind))
        );
        assert_eq!(
            attribute(span, "messaging.destination.name"),
            Some(&Value::from(exchange.to_owned()))
        );
        assert!(
            attribute(span, "messaging.rabbitmq.destination.routing_key").is_some(),
            "{span:#?}"
        );
    }
    assert_eq!(
        attribute(publish, "messaging.rabbitmq.destination.routing_key"),
        attribute(process, "messaging.rabbitmq.destination.routing_key")
    );
    assert_eq!(
        attribute(publish, "messaging.message.id"),
        attribute(process, "messaging.message.id")
    );
    assert!(matches!(
        attribute(process, "messaging.rabbitmq.message.delivery_tag"),
        Some(Value::I64(_))
    ));
}

fn in_trace<'a>(spans: &'a [SpanData], prefix: &str) -> Vec<&'a SpanData> {
    spans
        .iter()
        .filter(|span| span.name.starts_with(prefix))
        .filter(|span| span.span_context.trace_id().to_string() == TRACE_ID)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_receipt_joins_the_trace_of_the_request_through_rabbitmq() {
    let captured = CapturedSpans::install();
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let user = app.create_user(GOOD_CARD).await;
    let mut request = authed(&user.token, Some(&new_key()), ride_request());
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-b7ad6b7169203331-01")
            .parse()
            .unwrap(),
    );
    app.client().await.create_ride(request).await.unwrap();

    let enqueued = common::enqueuer(&app.pool, &broker, 100)
        .run_once()
        .await
        .unwrap();
    assert_eq!(enqueued.published, 1);
    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let received = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(received.sent, 1);

    let spans = captured.spans();
    // A fresh key's receipt is staged by the phase that records its charge.
    let phase = in_trace(&spans, "phase ride_created");
    assert_eq!(
        phase.len(),
        1,
        "the request's staging phase is in the trace"
    );
    let publish = in_trace(&spans, "publish ");
    assert_eq!(publish.len(), 1, "the enqueue is in the trace: {spans:#?}");
    let publish = publish[0];
    assert_eq!(publish.span_kind, opentelemetry::trace::SpanKind::Producer);
    // Staged inside the ride_created phase's transaction: the publish continues from there.
    assert_eq!(publish.parent_span_id, phase[0].span_context.span_id());

    let process = in_trace(&spans, "process ");
    assert_eq!(process.len(), 1, "the receipt is in the trace");
    let process = process[0];
    assert_eq!(process.span_kind, opentelemetry::trace::SpanKind::Consumer);
    assert_eq!(process.parent_span_id, publish.span_context.span_id());
    assert!(
        process
            .links
            .iter()
            .any(|link| link.span_context.span_id() == publish.span_context.span_id()),
        "the process span links to the publish"
    );
    assert_messaging_attributes(publish, process, &broker.topology.exchange);
    broker.cleanup().await;
}
