//! `GET /metrics` in the Prometheus text format, on its own small HTTP server so a scrape never
//! competes with the gRPC port. A scraper needs one connection: the endpoint holds few, and drops
//! one that has not sent its request headers in time.

use std::{convert::Infallible, future::Future, net::SocketAddr, os::fd::AsRawFd, time::Duration};

use bytes::Bytes;
use http::{Response, StatusCode, header::CONTENT_TYPE};
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{Encoder, TextEncoder};
use tokio::net::TcpListener;

use crate::accept::{ConnectionLimits, accept};

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

/// Serves `registry` on `listener` until `shutdown` completes, with the default limits.
pub async fn serve_metrics(
    listener: TcpListener,
    registry: prometheus::Registry,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    serve_metrics_with_limits(listener, registry, MetricsServerLimits::default(), shutdown).await;
}

/// Serves `registry` on `listener` until `shutdown` completes.
pub async fn serve_metrics_with_limits(
    listener: TcpListener,
    registry: prometheus::Registry,
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
        let registry = registry.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |request: hyper::Request<Incoming>| {
                let registry = registry.clone();
                async move { Ok::<_, Infallible>(answer(request.uri().path(), &registry)) }
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

fn answer(path: &str, registry: &prometheus::Registry) -> Response<Full<Bytes>> {
    let (status, content_type, body) = if path == "/metrics" {
        let mut buffer = Vec::new();
        match TextEncoder::new().encode(&registry.gather(), &mut buffer) {
            Ok(()) => (
                StatusCode::OK,
                TextEncoder::new().format_type().to_owned(),
                buffer,
            ),
            Err(error) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain".to_owned(),
                error.to_string().into_bytes(),
            ),
        }
    } else {
        (
            StatusCode::NOT_FOUND,
            "text/plain".to_owned(),
            b"not found\n".to_vec(),
        )
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(CONTENT_TYPE, value);
    }
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

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpStream,
    };

    use super::*;

    async fn spawn(limits: MetricsServerLimits) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_metrics_with_limits(
            listener,
            prometheus::Registry::new(),
            limits,
            std::future::pending(),
        ));
        addr
    }

    /// Everything the server sends until it closes the connection.
    async fn until_closed(tcp: &mut TcpStream) -> String {
        let mut answer = Vec::new();
        let _ = tcp.read_to_end(&mut answer).await;
        String::from_utf8_lossy(&answer).into_owned()
    }

    const SCRAPE: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

    #[tokio::test]
    async fn a_half_sent_request_is_dropped_after_the_header_timeout() {
        let addr = spawn(MetricsServerLimits {
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
        let addr = spawn(MetricsServerLimits {
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
