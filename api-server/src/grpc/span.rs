//! The server span of each RPC, and the trace context a caller may continue.

use std::{future::Future, time::Instant};

use opentelemetry::trace::TraceContextExt;
use telemetry::{
    attr,
    semconv::{RPC_SYSTEM_GRPC, attribute, grpc_status_code},
};
use tonic::{Response, Status, metadata::MetadataMap};
use tracing::{Instrument, Span, field};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::metrics::metrics;

use super::*;

/// `rpc.method` of each RPC: the fully-qualified method, as the conventions name it (and as tonic
/// routes it, less the leading `/`); also the span's name.
pub(super) const CREATE_RIDE: &str = "rides.v1.RideService/CreateRide";
pub(super) const GET_RIDE: &str = "rides.v1.RideService/GetRide";

/// The server span of one RPC, `method` being [`CREATE_RIDE`] or [`GET_RIDE`]. It continues the
/// caller's trace context only if `trusted` (an authenticated caller); otherwise it is a root,
/// linked to the caller's context. The parent must be chosen here, before the span is first
/// entered.
pub(super) fn rpc_span(
    method: &'static str,
    caller_trace: opentelemetry::Context,
    trusted: bool,
) -> Span {
    let span = tracing::info_span!(
        "rpc",
        otel.name = method,
        otel.kind = "server",
        otel.status_code = field::Empty,
        { attribute::RPC_SYSTEM_NAME } = RPC_SYSTEM_GRPC,
        { attribute::RPC_METHOD } = method,
        { attribute::RPC_RESPONSE_STATUS_CODE } = field::Empty,
        trace_id = field::Empty,
        user.id = field::Empty,
        rides.idempotency_key = field::Empty,
        rides.replayed = field::Empty,
    );
    let caller = caller_trace.span().span_context().clone();
    if caller.is_valid() {
        if trusted {
            let _ = span.set_parent(caller_trace);
        } else {
            span.add_link(caller);
        }
    }
    telemetry::record_trace_id(&span);
    span
}

/// Runs one RPC inside its server span, and records its status code on the span and in
/// `rpc.server.call.duration` (from `started`, so admission's wait is counted).
pub(super) async fn traced<T>(
    method: &'static str,
    started: Instant,
    span: Span,
    handler: impl Future<Output = Result<Response<T>, Status>>,
) -> Result<Response<T>, Status> {
    let result = handler.instrument(span.clone()).await;
    let code = match &result {
        Ok(_) => tonic::Code::Ok,
        Err(status) => status.code(),
    };
    let status_code = grpc_status_code(code as i32);
    span.record(attribute::RPC_RESPONSE_STATUS_CODE, status_code);
    if matches!(
        code,
        tonic::Code::Internal | tonic::Code::Unavailable | tonic::Code::Unknown
    ) {
        span.record("otel.status_code", "ERROR");
    }
    metrics().rpc_duration.record(
        started.elapsed().as_secs_f64(),
        &[
            attr(attribute::RPC_SYSTEM_NAME, RPC_SYSTEM_GRPC),
            attr(attribute::RPC_METHOD, method),
            attr(attribute::RPC_RESPONSE_STATUS_CODE, status_code),
        ],
    );
    result
}

/// The RPC's server span. Only an admitted caller (its credential verified) may continue its own
/// trace, choosing the trace id and the sampling decision; anyone else's is a linked root.
pub(super) fn server_span(method: &'static str, metadata: &MetadataMap, admitted: bool) -> Span {
    let caller_trace = telemetry::extract(&MetadataExtractor(metadata));
    rpc_span(method, caller_trace, admitted)
}
