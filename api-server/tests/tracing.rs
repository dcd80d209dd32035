//! One trace per ride: the caller's `traceparent` is continued by the server span, the claim, each
//! phase and the Stripe call are its descendants, and the staged receipt carries the context on.
//! Spans are captured with an in-memory exporter (this file is its own test process).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use api_server::testing::*;
use opentelemetry::{Value, trace::SpanKind};
use telemetry::testing::{CapturedSpans, SpanData};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN_ID: &str = "00f067aa0ba902b7";

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|span| span.name == name).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn one_trace_covers_the_request_its_phases_the_charge_and_the_staged_receipt() {
    let captured = CapturedSpans::install();
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let mut request = authed(&user.token, Some(&key), ride_request());
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-{CALLER_SPAN_ID}-01")
            .parse()
            .unwrap(),
    );

    app.client().await.create_ride(request).await.unwrap();

    // The server span ends just after the answer is written; give the exporter a moment.
    let mut spans = Vec::new();
    for _ in 0..100 {
        spans = captured.spans();
        if !named(&spans, "rides.v1.RideService/CreateRide").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ours: Vec<SpanData> = spans
        .into_iter()
        .filter(|span| span.span_context.trace_id().to_string() == TRACE_ID)
        .collect();

    let root = the_server_span(&ours);
    assert_the_claim_phase_and_charge_descend_from(&ours, root);

    // The receipt job carries the trace on to the enqueuer and the receipt worker.
    let jobs = app.staged_jobs().await;
    let traceparent = jobs[0].trace_context["traceparent"].as_str().unwrap();
    assert!(
        traceparent.starts_with(&format!("00-{TRACE_ID}-")),
        "{traceparent}"
    );
}

/// The one server span of the caller's trace, a child of the caller's span with the RPC's
/// attributes.
fn the_server_span(ours: &[SpanData]) -> &SpanData {
    let root = named(ours, "rides.v1.RideService/CreateRide");
    assert_eq!(
        root.len(),
        1,
        "one server span in the caller's trace: {ours:#?}"
    );
    let root = root[0];
    assert_eq!(root.parent_span_id.to_string(), CALLER_SPAN_ID);
    assert_eq!(root.span_kind, SpanKind::Server);
    // The names as the current RPC conventions spell them (the crate's constants are checked
    // against the specification's strings here, not merely against themselves).
    assert_eq!(
        attribute(root, "rpc.system.name"),
        Some(&Value::from("grpc"))
    );
    assert_eq!(
        attribute(root, "rpc.method"),
        Some(&Value::from("rides.v1.RideService/CreateRide"))
    );
    assert_eq!(
        attribute(root, "rpc.response.status_code"),
        Some(&Value::from("OK"))
    );
    assert_eq!(attribute(root, "rpc.system"), None);
    assert_eq!(attribute(root, "rpc.grpc.status_code"), None);
    assert_eq!(attribute(root, "rides.replayed"), Some(&Value::Bool(false)));
    root
}

/// The claim and the charging phase are children of the server span, the Stripe call a child of
/// the phase, and no span stands for a phase that commits with another.
fn assert_the_claim_phase_and_charge_descend_from(ours: &[SpanData], root: &SpanData) {
    let claim = named(ours, "claim idempotency key");
    assert_eq!(claim.len(), 1);
    assert_eq!(claim[0].parent_span_id, root.span_context.span_id());
    assert_eq!(
        attribute(claim[0], "rides.claim"),
        Some(&Value::from("execute"))
    );
    // A fresh key's claim commits phase `started` with the key: no span of its own.
    assert_eq!(
        attribute(claim[0], "rides.recovery_point.to"),
        Some(&Value::from("ride_created"))
    );
    assert!(named(ours, "phase started").is_empty());
    // And the charge's record finishes it: no `phase charge_created` either.
    assert!(named(ours, "phase charge_created").is_empty());

    let phase = named(ours, "phase ride_created");
    assert_eq!(phase.len(), 1);
    assert_eq!(phase[0].parent_span_id, root.span_context.span_id());
    assert_eq!(
        attribute(phase[0], "rides.recovery_point.to"),
        Some(&Value::from("finished"))
    );
    assert_eq!(
        attribute(phase[0], "db.system.name"),
        Some(&Value::from("postgresql"))
    );

    let charge = named(ours, "POST /v1/payment_intents");
    assert_eq!(charge.len(), 1);
    let charging_phase = named(ours, "phase ride_created")[0];
    assert_eq!(
        charge[0].parent_span_id,
        charging_phase.span_context.span_id()
    );
    assert_eq!(charge[0].span_kind, SpanKind::Client);
    assert_eq!(
        attribute(charge[0], "http.request.method"),
        Some(&Value::from("POST"))
    );
    assert_eq!(
        attribute(charge[0], "http.response.status_code"),
        Some(&Value::I64(200))
    );
}

/// The server spans of the RPC `method` captured so far, waiting a moment for the exporter.
async fn server_spans(captured: &CapturedSpans, method: &str, at_least: usize) -> Vec<SpanData> {
    let name = format!("rides.v1.RideService/{method}");
    for _ in 0..100 {
        let spans: Vec<SpanData> = captured
            .spans()
            .into_iter()
            .filter(|span| span.name == name)
            .collect();
        if spans.len() >= at_least {
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("fewer than {at_least} {name} spans");
}

#[tokio::test(flavor = "multi_thread")]
async fn only_an_authenticated_caller_chooses_the_trace() {
    const STRANGER_TRACE: &str = "5bf92f3577b34da6a3ce929d0e0e4737";
    const RIDER_TRACE: &str = "6bf92f3577b34da6a3ce929d0e0e4738";
    let captured = CapturedSpans::install();
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let traced = |token: &str, trace: &str| {
        let mut request = authed(token, None, proto::v1::GetRideRequest { id: 1 });
        request.metadata_mut().insert(
            "traceparent",
            format!("00-{trace}-{CALLER_SPAN_ID}-01").parse().unwrap(),
        );
        request
    };
    let mut client = app.client().await;

    // A bad token: its call is a root of a new trace, only linked to the caller's context.
    let status = client
        .get_ride(traced("rr_not-a-real-token", STRANGER_TRACE))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let spans = server_spans(&captured, "GetRide", 1).await;
    assert_eq!(spans.len(), 1);
    let stranger = &spans[0];
    assert_ne!(stranger.span_context.trace_id().to_string(), STRANGER_TRACE);
    assert_eq!(
        stranger.parent_span_id,
        opentelemetry::trace::SpanId::INVALID
    );
    let links: Vec<String> = stranger
        .links
        .iter()
        .map(|link| link.span_context.trace_id().to_string())
        .collect();
    assert_eq!(links, [STRANGER_TRACE]);
    assert!(
        captured
            .spans()
            .iter()
            .all(|span| span.span_context.trace_id().to_string() != STRANGER_TRACE)
    );

    // An authenticated caller's call continues its trace.
    let status = client
        .get_ride(traced(&user.token, RIDER_TRACE))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound);
    let spans = server_spans(&captured, "GetRide", 2).await;
    let rider = spans
        .iter()
        .find(|span| span.span_context.trace_id().to_string() == RIDER_TRACE)
        .unwrap_or_else(|| panic!("the rider's trace was not continued: {spans:#?}"));
    assert_eq!(rider.parent_span_id.to_string(), CALLER_SPAN_ID);
}
