//! Spans and trace propagation: one client span per call and one per attempt, with the
//! OpenTelemetry RPC attributes, and each attempt's trace context carried in its metadata so the
//! server's span is its child. Captured with an in-memory exporter (this file is its own test
//! process under nextest).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use api_server::testing::{GOOD_CARD, TestApp, ride_request};
use fake_stripe::FaultMode;
use opentelemetry::{Value, trace::SpanKind};
use rides_client::{Credential, RidesClient};
use telemetry::testing::{CapturedSpans, SpanData};

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

#[tokio::test(flavor = "multi_thread")]
async fn each_attempt_is_a_client_span_whose_context_the_server_continues() {
    let captured = CapturedSpans::install();
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    app.stripe.inject_faults(FaultMode::Error500, 1);
    let client = RidesClient::new(app.channel().await, Credential::user(&user.token));

    let created = client.create_ride(ride_request()).await.unwrap();
    assert_eq!(created.attempts(), 2);

    // Server spans end just after their answers are written; give the exporter a moment.
    let server_spans = |spans: &[SpanData]| -> Vec<SpanData> {
        spans
            .iter()
            .filter(|s| s.span_kind == SpanKind::Server && s.name.ends_with("/CreateRide"))
            .cloned()
            .collect()
    };
    let mut spans = Vec::new();
    for _ in 0..100 {
        spans = captured.spans();
        if server_spans(&spans).len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client_spans: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.span_kind == SpanKind::Client && s.name == "rides.v1.RideService/CreateRide")
        .collect();
    let (attempts, calls): (Vec<&SpanData>, Vec<&SpanData>) = client_spans
        .into_iter()
        .partition(|s| attribute(s, "rides.attempt").is_some());
    assert_eq!(calls.len(), 1, "{spans:#?}");
    let call = calls[0];
    assert_eq!(
        attribute(call, "rpc.system.name"),
        Some(&Value::from("grpc"))
    );
    assert_eq!(attribute(call, "rpc.service"), None);
    assert_eq!(
        attribute(call, "rpc.method"),
        Some(&Value::from("rides.v1.RideService/CreateRide"))
    );
    assert_eq!(
        attribute(call, "rpc.response.status_code"),
        Some(&Value::from("OK"))
    );
    assert_eq!(attribute(call, "rides.attempts"), Some(&Value::I64(2)));

    assert_eq!(attempts.len(), 2);
    let server = server_spans(&spans);
    for attempt in &attempts {
        assert_eq!(attempt.parent_span_id, call.span_context.span_id());
        assert_eq!(
            attempt.span_context.trace_id(),
            call.span_context.trace_id()
        );
        let code = match attribute(attempt, "rides.attempt") {
            Some(Value::I64(1)) => "UNAVAILABLE", // the provider's 500
            Some(Value::I64(2)) => "OK",
            other => panic!("unexpected attempt number {other:?}"),
        };
        assert_eq!(
            attribute(attempt, "rpc.response.status_code"),
            Some(&Value::from(code))
        );
        // The server continued this attempt's context: its span is the attempt's child.
        let children: Vec<_> = server
            .iter()
            .filter(|s| s.parent_span_id == attempt.span_context.span_id())
            .collect();
        assert_eq!(children.len(), 1, "server span of attempt: {server:#?}");
        assert_eq!(
            children[0].span_context.trace_id(),
            call.span_context.trace_id()
        );
    }
}
