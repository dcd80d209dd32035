//! The relay's message search over HTTP (Mailpit's `GET /api/v1/search?query=message-id:<id>`
//! shape), asked by the receipt worker after a crash.

use std::{
    convert::Infallible,
    sync::{Arc, PoisonError},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{StatusCode, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::*;

pub(crate) async fn serve_http(listener: TcpListener, state: Arc<State>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let service = service_fn(move |request: hyper::Request<Incoming>| {
                let answer = search(&state, request.uri());
                async move { Ok::<_, Infallible>(answer) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// `GET /api/v1/search?query=message-id:<id>`, answered in Mailpit's shape. Only Message-ID
/// searches are supported; anything else is a 400 rather than a silently empty answer.
pub(crate) fn search(state: &State, uri: &hyper::Uri) -> hyper::Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: serde_json::Value| {
        let mut response = hyper::Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        response.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        response
    };
    if uri.path() != "/api/v1/search" {
        return reply(
            StatusCode::NOT_FOUND,
            serde_json::json!({"Error": "not found"}),
        );
    }
    {
        let mut failures = state
            .search_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *failures > 0 {
            *failures -= 1;
            return reply(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({"Error": "injected failure"}),
            );
        }
    }
    let query = uri
        .query()
        .and_then(|q| serde_urlencoded::from_str::<Vec<(String, String)>>(q).ok())
        .and_then(|pairs| pairs.into_iter().find(|(k, _)| k == "query"))
        .map(|(_, v)| v)
        .unwrap_or_default();
    let Some(wanted) = query.trim().strip_prefix("message-id:") else {
        return reply(
            StatusCode::BAD_REQUEST,
            serde_json::json!({"Error": "only message-id:<id> searches are supported"}),
        );
    };
    let wanted = bare(wanted.trim_matches('"'));
    let mails = state.mails();
    let messages: Vec<serde_json::Value> = mails
        .with_message_id(wanted)
        .into_iter()
        .map(|(seq, mail)| {
            serde_json::json!({
                "ID": seq.to_string(),
                "MessageID": wanted,
                "Subject": mail.header("Subject").unwrap_or_default(),
            })
        })
        .collect();
    reply(
        StatusCode::OK,
        serde_json::json!({
            "total": mails.len(),
            "unread": mails.len(),
            "count": messages.len(),
            "messages_count": messages.len(),
            "start": 0,
            "tags": [],
            "messages": messages,
        }),
    )
}

/// `<id@host>` → `id@host`, as a relay compares Message-IDs. Deliberately the sink's own and not
/// the receipt worker's (`workers::relay_search::bare`): the sink stands in for a real relay, as
/// fake-stripe does for Stripe, so it must not borrow its client's reading of the protocol (and
/// it does not depend on the fleet).
pub(crate) fn bare(message_id: &str) -> &str {
    let trimmed = message_id.trim();
    trimmed
        .strip_prefix('<')
        .and_then(|rest| rest.strip_suffix('>'))
        .unwrap_or(trimmed)
}
