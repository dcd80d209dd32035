//! `GET /metrics` in the Prometheus text format, on its own small HTTP server so a scrape never
//! competes with the gRPC port. A scraper needs one connection: the endpoint holds few, and drops
//! one that has not sent its request headers in time.

use std::{convert::Infallible, future::Future, net::SocketAddr, os::fd::AsRawFd, time::Duration};

use bytes::Bytes;
use http::{Response, StatusCode, header::CONTENT_TYPE};
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::{
    PrometheusExporter,
    accept::{ConnectionLimits, accept},
};

/// The Prometheus text format, version 0.0.4: what scrapers ask for and what the exporter writes.
/// Its `# UNIT` lines are comments to a 0.0.4 parser.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4";

/// The metrics endpoint's limits.
#[derive(Clone, Copy, Debug)]
pub struct MetricsServerLimits {
    /// Connections open at once; more are closed right after accept.
    pub max_connections: usize,
    /// A connection that has not sent a request's headers this long after it opened (or after
    /// its previous response) is closed.
    pub header_read_timeout: Duration,
}

impl Default for MetricsServerLimits {
    fn default() -> MetricsServerLimits {
        MetricsServerLimits {
            max_connections: 32,
            header_read_timeout: Duration::from_secs(10),
        }
    }
}

/// Serves `exporter` on `listener` until `shutdown` completes, with the default limits.
pub async fn serve_metrics(
    listener: TcpListener,
    exporter: PrometheusExporter,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    serve_metrics_with_limits(listener, exporter, MetricsServerLimits::default(), shutdown).await;
}

/// Serves `exporter` on `listener` until `shutdown` completes.
pub async fn serve_metrics_with_limits(
    listener: TcpListener,
    exporter: PrometheusExporter,
    limits: MetricsServerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    // Scrapers are few and known: one cap for all, none per address, and no descriptor reserve:
    // the cap is small, and a process short of descriptors is exactly when an on-call scrapes.
    let connections = ConnectionLimits::new(limits.max_connections, usize::MAX, 0);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return,
            accepted = accept(&listener) => accepted,
        };
        let Ok(permit) = connections.admit(peer.ip(), stream.as_raw_fd()) else {
            tracing::debug!(%peer, "metrics endpoint: too many connections; closed");
            continue;
        };
        let exporter = exporter.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |request: hyper::Request<Incoming>| {
                let exporter = exporter.clone();
                async move { Ok::<_, Infallible>(answer(request.uri().path(), &exporter)) }
            });
            // hyper enforces the header timeout only with a timer.
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn answer(path: &str, exporter: &PrometheusExporter) -> Response<Full<Bytes>> {
    let (status, content_type, body) = if path == "/metrics" {
        let mut buffer = Vec::new();
        match exporter.export(&mut buffer) {
            Ok(()) => (StatusCode::OK, TEXT_FORMAT, buffer),
            Err(error) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                error.to_string().into_bytes(),
            ),
        }
    } else {
        (StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec())
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    response
}

/// The address a process serves metrics on: `METRICS_LISTEN_ADDR`, `default` when unset, none
/// when set to `off`.
pub fn metrics_addr(default: SocketAddr) -> Result<Option<SocketAddr>, std::net::AddrParseError> {
    match std::env::var("METRICS_LISTEN_ADDR") {
        Ok(value) if value == "off" => Ok(None),
        Ok(value) if !value.is_empty() => value.parse().map(Some),
        _ => Ok(Some(default)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use opentelemetry_sdk::metrics::SdkMeterProvider;
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpStream,
    };

    use super::*;

    /// The endpoint on a free port, its exporter read by a meter provider (a reader no provider
    /// reads answers 500); keep the provider as long as the endpoint is scraped.
    async fn spawn(limits: MetricsServerLimits) -> (SocketAddr, SdkMeterProvider) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let exporter = PrometheusExporter::new();
        let provider = SdkMeterProvider::builder()
            .with_reader(exporter.clone())
            .build();
        tokio::spawn(serve_metrics_with_limits(
            listener,
            exporter,
            limits,
            std::future::pending(),
        ));
        (addr, provider)
    }

    /// Everything the server sends until it closes the connection.
    async fn until_closed(tcp: &mut TcpStream) -> String {
        let mut answer = Vec::new();
        let _ = tcp.read_to_end(&mut answer).await;
        String::from_utf8_lossy(&answer).into_owned()
    }

    const SCRAPE: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

    #[tokio::test]
    async fn a_scrape_answers_the_text_format_with_what_was_recorded() {
        use opentelemetry::metrics::MeterProvider as _;

        let (addr, provider) = spawn(MetricsServerLimits::default()).await;
        provider
            .meter("scope")
            .u64_counter("rides.things")
            .build()
            .add(2, &[]);
        let mut scraper = TcpStream::connect(addr).await.unwrap();
        scraper.write_all(SCRAPE).await.unwrap();
        let answer = until_closed(&mut scraper).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(
            answer.contains("content-type: text/plain; version=0.0.4\r\n"),
            "{answer}"
        );
        assert!(
            answer.contains("\nrides_things_total{otel_scope_name=\"scope\"} 2\n"),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn a_half_sent_request_is_dropped_after_the_header_timeout() {
        let (addr, _provider) = spawn(MetricsServerLimits {
            max_connections: 4,
            header_read_timeout: Duration::from_millis(200),
        })
        .await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let answer = until_closed(&mut slow).await;
        assert!(!answer.contains("200 OK"), "answered: {answer}");

        let mut scraper = TcpStream::connect(addr).await.unwrap();
        scraper.write_all(SCRAPE).await.unwrap();
        assert!(
            until_closed(&mut scraper)
                .await
                .starts_with("HTTP/1.1 200 OK")
        );
    }

    #[tokio::test]
    async fn connections_over_the_cap_are_closed_at_once() {
        let (addr, _provider) = spawn(MetricsServerLimits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(60),
        })
        .await;
        let mut first = TcpStream::connect(addr).await.unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        let _ = second.write_all(SCRAPE).await;
        assert_eq!(until_closed(&mut second).await, "");
        first.write_all(SCRAPE).await.unwrap();
        assert!(
            until_closed(&mut first)
                .await
                .starts_with("HTTP/1.1 200 OK")
        );
    }
}
