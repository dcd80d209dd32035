//! `GET /metrics` in the Prometheus text format, on its own small HTTP server so a scrape never
//! competes with the gRPC port.

use std::{convert::Infallible, future::Future, net::SocketAddr};

use bytes::Bytes;
use http::{Response, StatusCode, header::CONTENT_TYPE};
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use prometheus::{Encoder, TextEncoder};
use tokio::net::TcpListener;

/// Serves `registry` on `listener` until `shutdown` completes. Returns the bound address's task.
pub async fn serve_metrics(
    listener: TcpListener,
    registry: prometheus::Registry,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: hyper::Request<Incoming>| {
                let registry = registry.clone();
                async move { Ok::<_, Infallible>(answer(request.uri().path(), &registry)) }
            });
            let _ = http1::Builder::new()
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
