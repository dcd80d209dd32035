//! The client's spans: one per logical call and one per attempt, with the OpenTelemetry RPC
//! attributes, and the trace context each attempt carries to the server.

use telemetry::semconv::{RPC_SYSTEM_GRPC, attribute, grpc_status_code};
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue, MetadataMap};
use tracing::{Span, field};

use crate::client::SERVICE;

/// The span of a logical call (`attempt: None`) or of one of its attempts (a child of the
/// call's), with the OpenTelemetry RPC attributes. The key appears only as its first 6
/// characters, as in every log of this system.
pub(crate) fn rpc_span(method: &'static str, attempt: Option<u32>, key: Option<&str>) -> Span {
    let key_prefix = key.map(|key| key.chars().take(6).collect::<String>());
    tracing::info_span!(
        "rpc.client",
        otel.name = %format_args!("{SERVICE}/{method}"),
        otel.kind = "client",
        { attribute::RPC_SYSTEM_NAME } = RPC_SYSTEM_GRPC,
        { attribute::RPC_METHOD } = %format_args!("{SERVICE}/{method}"),
        { attribute::RPC_RESPONSE_STATUS_CODE } = field::Empty,
        rides.attempt = attempt.map(i64::from),
        rides.key_prefix = key_prefix.as_deref(),
        rides.attempts = field::Empty,
        rides.replayed = field::Empty,
    )
}

pub(crate) fn record_code(span: &Span, code: Option<tonic::Code>) {
    if let Some(code) = code {
        span.record(
            attribute::RPC_RESPONSE_STATUS_CODE,
            grpc_status_code(i32::from(code)),
        );
    }
}

/// The call's span (the current one inside the retry loop) gets the final answer's code and the
/// attempts made, once: an exporter keeps every value recorded, not the last.
pub(crate) fn finish_call_span(attempts: u32, code: Option<tonic::Code>) {
    let span = Span::current();
    record_code(&span, code);
    span.record("rides.attempts", i64::from(attempts));
}

/// W3C `traceparent` (and `tracestate`) of the attempt's span, so that the server's spans join
/// the caller's trace.
pub(crate) fn inject_trace_context(metadata: &mut MetadataMap, span: &Span) {
    for (name, value) in span.in_scope(telemetry::inject_current) {
        if let (Ok(name), Ok(value)) = (
            AsciiMetadataKey::from_bytes(name.as_bytes()),
            AsciiMetadataValue::try_from(value),
        ) {
            metadata.insert(name, value);
        }
    }
}
