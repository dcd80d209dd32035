//! Tracing, metrics and logs for every Rocket Rides process, set up once at start.
//!
//! - Traces: `tracing` spans exported through OpenTelemetry. With `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   set they go to that collector over OTLP/gRPC (sampled by the standard `OTEL_TRACES_SAMPLER`);
//!   without it nothing is exported and nothing fails, but spans still carry W3C trace ids, so
//!   the trace context can be propagated and logged.
//! - Propagation: W3C `traceparent`/`tracestate`, through gRPC metadata, the staged job row and
//!   AMQP headers ([`inject_current`], [`extract`]).
//! - Metrics: OpenTelemetry instruments (see [`meter`]), exported over OTLP when configured and
//!   always readable in the Prometheus text format on `METRICS_LISTEN_ADDR` ([`serve_metrics`],
//!   rendered by `opentelemetry-prometheus-text-exporter` at each scrape).
//! - Listeners: [`accept`] is every TCP listener's accept loop (back-off when out of descriptors)
//!   and its caps on open connections; the metrics endpoint caps connections and header time.
//! - Settings: [`settings::Vars`], the one reader of environment variables every process's
//!   typed configuration goes through.
//! - Logs: `RUST_LOG` filtering, JSON lines when `LOG_FORMAT=json`. Each request's or job's root
//!   span records `trace_id`, so every line logged inside it carries the trace id.
//!
//! The log filter applies to the log output only: `RUST_LOG=warn` must not silence exported spans.

use std::collections::HashMap;

use opentelemetry::{
    Context, KeyValue,
    propagation::{Extractor, Injector, TextMapPropagator},
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_sdk::{
    Resource, metrics::SdkMeterProvider, propagation::TraceContextPropagator,
    trace::SdkTracerProvider,
};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    EnvFilter, Layer, Registry,
    filter::{LevelFilter, Targets},
    layer::{Filter, SubscriberExt},
};

pub mod accept;
mod metrics_endpoint;
pub mod semconv;
pub mod settings;

pub use metrics_endpoint::{
    MetricsServerLimits, metrics_addr, serve_metrics, serve_metrics_with_limits,
};
pub use opentelemetry::metrics::Meter;
pub use opentelemetry_prometheus_text_exporter::PrometheusExporter;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot build the OTLP exporter")]
    Otlp(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("a global tracing subscriber is already installed")]
    SubscriberAlreadySet(#[from] tracing::subscriber::SetGlobalDefaultError),
}

/// The installed providers. Keep it alive for the life of the process and call
/// [`Telemetry::shutdown`] at the end so buffered spans and metrics are flushed.
pub struct Telemetry {
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
    prometheus: PrometheusExporter,
}

impl Telemetry {
    /// Installs the global tracing subscriber, tracer and meter providers and the W3C propagator.
    /// `default_service_name` is used unless `OTEL_SERVICE_NAME` is set.
    pub fn init(default_service_name: &str) -> Result<Telemetry, TelemetryError> {
        let service_name = std::env::var("OTEL_SERVICE_NAME")
            .ok()
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| default_service_name.to_owned());
        let otlp = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
            .ok()
            .filter(|endpoint| !endpoint.is_empty())
            .is_some();
        let resource = Resource::builder()
            .with_service_name(service_name.clone())
            .build();

        let mut tracer_builder = SdkTracerProvider::builder().with_resource(resource.clone());
        if otlp {
            // The exporter reads the standard OTEL_EXPORTER_OTLP_* variables itself.
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .build()?;
            tracer_builder = tracer_builder.with_batch_exporter(exporter);
        }
        let tracer_provider = tracer_builder.build();

        let prometheus = prometheus_exporter();
        let mut meter_builder = SdkMeterProvider::builder()
            .with_resource(resource)
            .with_reader(prometheus.clone());
        if otlp {
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_tonic()
                .build()?;
            meter_builder = meter_builder.with_periodic_exporter(exporter);
        }
        let meter_provider = meter_builder.build();

        install(
            &tracer_provider,
            &service_name,
            std::env::var("LOG_FORMAT").is_ok_and(|format| format == "json"),
        )?;
        opentelemetry::global::set_meter_provider(meter_provider.clone());
        Ok(Telemetry {
            tracer_provider,
            meter_provider,
            prometheus,
        })
    }

    /// The reader [`serve_metrics`] renders at each scrape.
    pub fn prometheus(&self) -> PrometheusExporter {
        self.prometheus.clone()
    }

    /// Flushes and stops the exporters.
    pub fn shutdown(self) {
        if let Err(error) = self.tracer_provider.shutdown() {
            tracing::warn!(%error, "flushing spans failed");
        }
        if let Err(error) = self.meter_provider.shutdown() {
            tracing::warn!(%error, "flushing metrics failed");
        }
    }
}

/// The `/metrics` reader. Its defaults are the naming the alert rules, recording rules, dashboard
/// and tests read (the same as opentelemetry-prometheus's): dots become underscores, a counter
/// ends in `_total`, a unit becomes a suffix (`s` → `_seconds`; an annotation such as
/// `{request}` adds none), every series carries `otel_scope_name`, and the resource is one
/// `target_info` series. `tests::the_exposition_keeps_the_names_the_rules_read` pins them.
fn prometheus_exporter() -> PrometheusExporter {
    PrometheusExporter::builder().build()
}

/// Installs the subscriber: the log layer filtered by `RUST_LOG` (default `info`, see
/// [`log_filter`]), the
/// OpenTelemetry layer filtered separately at INFO.
fn install(
    tracer_provider: &SdkTracerProvider,
    service_name: &str,
    json: bool,
) -> Result<(), TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    opentelemetry::global::set_tracer_provider(tracer_provider.clone());
    let tracer = tracer_provider.tracer(service_name.to_owned());
    let log_filter = log_filter(std::env::var(EnvFilter::DEFAULT_ENV).ok().as_deref());
    let log_layer = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed()
    };
    let subscriber = tracing_subscriber::registry()
        .with(log_layer.with_filter(log_filter))
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                // Both run on every poll of every instrumented future: under load `on_enter` was
                // the api-server's most expensive function of its own (4.5 % of its CPU at 500
                // clients). Nothing here reads `opentelemetry::Context::current()`:
                // propagation takes the context from the span (`OpenTelemetrySpanExt::context`).
                // The busy/idle timings they add are not semantic-convention attributes.
                .with_context_activation(false)
                .with_tracked_inactivity(false)
                .with_filter(LevelFilter::INFO),
        );
    tracing::subscriber::set_global_default(subscriber)?;
    Ok(())
}

/// The log output's filter from `RUST_LOG` (default `info`). A list of plain `target=level`
/// directives, the usual case, becomes a `Targets` filter, which decides once per callsite.
/// `EnvFilter`, kept for anything else (span and field directives), also takes a lock and a map
/// lookup on every enter and exit of every span, whether or not it logs: under load that was the
/// api-server's most expensive tracing work in CPU profiles.
fn log_filter(spec: Option<&str>) -> Box<dyn Filter<Registry> + Send + Sync> {
    let spec = spec.unwrap_or("info");
    match plain_targets(spec) {
        Some(targets) => Box::new(targets),
        None => Box::new(EnvFilter::try_new(spec).unwrap_or_else(|_| EnvFilter::new("info"))),
    }
}

/// `spec` as a `Targets` filter, if it says nothing `Targets` cannot (an empty spec keeps
/// `EnvFilter`'s meaning). `Targets` parses a span directive such as `[create_ride]=debug` without
/// error, as a target named `[create_ride]` that matches nothing, so brackets and braces are
/// checked here rather than left to the parser.
fn plain_targets(spec: &str) -> Option<Targets> {
    if spec.trim().is_empty() || spec.contains(['[', ']', '{', '}']) {
        return None;
    }
    spec.parse().ok()
}

/// The meter every instrument of a process is created from.
pub fn meter(name: &'static str) -> Meter {
    opentelemetry::global::meter(name)
}

/// Makes `span` a child of the W3C trace context in `carrier` (if any) and records its trace id
/// in the span's `trace_id` field, so that every log line inside it shows the trace id.
pub fn continue_trace(span: &tracing::Span, carrier: &dyn Extractor) {
    let parent = extract(carrier);
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
    record_trace_id(span);
}

/// Records the span's OpenTelemetry trace id in its `trace_id` field.
pub fn record_trace_id(span: &tracing::Span) {
    let trace_id = span.context().span().span_context().trace_id();
    span.record("trace_id", tracing::field::display(trace_id));
}

/// The trace context in `carrier`, as a W3C propagator reads it.
pub fn extract(carrier: &dyn Extractor) -> Context {
    TraceContextPropagator::new().extract(carrier)
}

/// The current span's W3C trace context (`traceparent`, and `tracestate` when set), for storing
/// with work that continues elsewhere (a staged job, an AMQP message).
pub fn inject_current() -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(
        &tracing::Span::current().context(),
        &mut MapCarrier(&mut carrier),
    );
    carrier
}

struct MapCarrier<'a>(&'a mut HashMap<String, String>);

impl Injector for MapCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

/// Reads a trace context from HTTP headers (gRPC metadata are HTTP/2 headers).
pub struct HeaderExtractor<'a>(pub &'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Reads a trace context from a string map (a staged job's `trace_context`, AMQP headers).
pub struct MapExtractor<'a>(pub &'a HashMap<String, String>);

impl Extractor for MapExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// A value that must never reach a log line or an error message (tokens, keys, URLs with
/// passwords): its `Debug` prints `Secret(****)`, and it has no `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value itself, for the one place that must send it (a header, a connection).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(****)")
    }
}

/// `error: cause: cause…`, so that a log line keeps an error's whole source chain.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `KeyValue` shorthand for metric attributes.
pub fn attr(key: &'static str, value: impl Into<opentelemetry::Value>) -> KeyValue {
    KeyValue::new(key, value)
}

/// For tests: a subscriber that exports finished spans to memory, installed globally (nextest
/// runs each test in its own process).
#[cfg(feature = "testing")]
pub mod testing {
    use opentelemetry::trace::TracerProvider as _;
    pub use opentelemetry_sdk::trace::SpanData;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt;

    pub struct CapturedSpans {
        exporter: InMemorySpanExporter,
        provider: SdkTracerProvider,
    }

    impl CapturedSpans {
        /// Installs the global subscriber. Call once per test process.
        pub fn install() -> CapturedSpans {
            opentelemetry::global::set_text_map_propagator(
                opentelemetry_sdk::propagation::TraceContextPropagator::new(),
            );
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let tracer = provider.tracer("test");
            let subscriber = tracing_subscriber::registry()
                .with(tracing_opentelemetry::layer().with_tracer(tracer));
            #[allow(clippy::expect_used)]
            tracing::subscriber::set_global_default(subscriber)
                .expect("one captured-span subscriber per test process");
            CapturedSpans { exporter, provider }
        }

        /// Every span finished so far.
        pub fn spans(&self) -> Vec<SpanData> {
            let _ = self.provider.force_flush();
            self.exporter.get_finished_spans().unwrap_or_default()
        }
    }
}

#[cfg(test)]
mod tests {
    use tracing::Level;

    use super::*;

    #[test]
    fn plain_directives_become_targets_and_span_directives_keep_env_filter() {
        let targets = plain_targets("api_server=debug,warn").unwrap();
        assert_eq!(targets.default_level(), Some(LevelFilter::WARN));
        assert!(targets.would_enable("api_server::rides", &Level::DEBUG));
        assert!(!targets.would_enable("h2::proto", &Level::INFO));
        assert!(plain_targets("info").is_some());
        assert!(plain_targets("[rpc{user.id=1}]=debug").is_none());
        assert!(plain_targets("[create_ride]=debug").is_none());
        assert!(plain_targets("warn,[create_ride]=debug").is_none());
        assert!(plain_targets("api_server[create_ride]=debug").is_none());
        assert!(plain_targets("[{rider}]=debug").is_none());
        assert!(plain_targets("").is_none());
    }

    /// What the log output prints for `spec`: one debug line inside a span named `create_ride`,
    /// one outside it, one warning, through the same filter and fmt layer the processes install.
    fn logged_under(spec: &str) -> String {
        #[derive(Clone, Default)]
        struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = Registry::default().with(
            tracing_subscriber::fmt::layer()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .with_filter(log_filter(Some(spec))),
        );
        tracing::subscriber::with_default(subscriber, || {
            tracing::info_span!("create_ride").in_scope(|| tracing::debug!("inside the span"));
            tracing::debug!("outside any span");
            tracing::warn!("a warning");
        });
        let bytes = buffer.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn span_directives_in_rust_log_select_the_lines_inside_that_span() {
        let logged = logged_under("warn,[create_ride]=debug");
        assert!(logged.contains("inside the span"), "{logged}");
        assert!(!logged.contains("outside any span"), "{logged}");
        assert!(logged.contains("a warning"), "{logged}");

        let logged = logged_under("[create_ride]=debug");
        assert!(logged.contains("inside the span"), "{logged}");
        assert!(!logged.contains("outside any span"), "{logged}");

        let logged = logged_under("warn");
        assert!(!logged.contains("inside the span"), "{logged}");
        assert!(logged.contains("a warning"), "{logged}");

        let logged = logged_under("debug");
        assert!(logged.contains("inside the span"), "{logged}");
        assert!(logged.contains("outside any span"), "{logged}");
    }

    /// The exposition's names and labels, for one instrument of each kind the processes create:
    /// the rules, the dashboard, the tests and the bench read exactly these.
    #[test]
    fn the_exposition_keeps_the_names_the_rules_read() {
        use opentelemetry::metrics::MeterProvider as _;

        let exporter = prometheus_exporter();
        let provider = SdkMeterProvider::builder()
            .with_resource(Resource::builder().with_service_name("rides-test").build())
            .with_reader(exporter.clone())
            .build();
        let meter = provider.meter("rides-test-scope");
        let seconds = meter.f64_histogram("rpc.server.call.duration");
        let seconds = seconds
            .with_unit("s")
            .with_boundaries(vec![0.5, 1.0])
            .build();
        seconds.record(0.75, &[attr("rpc.method", "CreateRide")]);
        let batch = meter.u64_histogram("rides.idempotency.batch.size");
        let batch = batch.with_unit("{request}").build();
        batch.record(2, &[attr("rides.batch.statement", "claim")]);
        let messages = meter.u64_counter("rides.receipts.messages").build();
        messages.add(3, &[attr("outcome", "sent")]);
        let age = meter.f64_gauge("rides.staged_jobs.oldest_age");
        age.with_unit("s").build().record(1.5, &[]);
        let mut text = Vec::new();
        exporter.export(&mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        let expected = r#"
rpc_server_call_duration_seconds_bucket{rpc_method="CreateRide",le="0.5",otel_scope_name="rides-test-scope"} 0
rpc_server_call_duration_seconds_bucket{rpc_method="CreateRide",le="1",otel_scope_name="rides-test-scope"} 1
rpc_server_call_duration_seconds_bucket{rpc_method="CreateRide",le="+Inf",otel_scope_name="rides-test-scope"} 1
rpc_server_call_duration_seconds_count{rpc_method="CreateRide",otel_scope_name="rides-test-scope"} 1
rpc_server_call_duration_seconds_sum{rpc_method="CreateRide",otel_scope_name="rides-test-scope"} 0.75
rides_idempotency_batch_size_sum{rides_batch_statement="claim",otel_scope_name="rides-test-scope"} 2
rides_receipts_messages_total{outcome="sent",otel_scope_name="rides-test-scope"} 3
rides_staged_jobs_oldest_age_seconds{otel_scope_name="rides-test-scope"} 1.5"#;
        for line in expected.lines().skip(1) {
            assert!(samples.contains(&line), "{line} not in:\n{text}");
        }
        assert!(text.contains("# TYPE rides_receipts_messages_total counter"));
        assert!(
            samples.iter().any(
                |l| l.starts_with("target_info{") && l.contains(r#"service_name="rides-test""#)
            ),
            "{text}"
        );
    }
}
