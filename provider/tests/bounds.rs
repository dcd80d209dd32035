//! The provider's answers are bounded (issue 29 item 5): a body larger than
//! `MAX_RESPONSE_BYTES` is not read (with or without a `Content-Length`), and a list that repeats
//! a page stops with an error instead of looping. Against a stand-in HTTP server on loopback that
//! misbehaves as asked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use provider::{
    CreatedWindow, MAX_RESPONSE_BYTES, ProviderError, Secret, StripeClient, StripeConfig,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

/// A server answering every request with `head` then `body`, then closing the connection.
async fn serve(head: String, body: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let (head, body) = (head.clone(), body.clone());
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0_u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(&body).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    format!("http://{addr}")
}

fn client(api_base: String) -> StripeClient {
    StripeClient::new(&StripeConfig {
        api_base,
        secret_key: Secret::new("sk_test_bounds"),
        timeout: Duration::from_secs(10),
        idempotency_window: Duration::from_secs(86_400),
        deployment_id: provider::DeploymentId::parse("test").unwrap(),
    })
    .unwrap()
}

const WINDOW: CreatedWindow = CreatedWindow { from: 0, until: 10 };

fn rejected_as(error: &ProviderError) -> &str {
    match error {
        ProviderError::Rejected { error_type, .. } => error_type,
        ProviderError::Unavailable { .. } => "unavailable",
    }
}

#[tokio::test]
async fn a_body_over_the_cap_is_not_read() {
    let huge = vec![b' '; MAX_RESPONSE_BYTES + 1];
    // Announced by its length: refused before reading.
    let announced = serve(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            huge.len()
        ),
        huge.clone(),
    )
    .await;
    let error = client(announced)
        .list_payment_intents(WINDOW)
        .await
        .unwrap_err();
    assert_eq!(rejected_as(&error), "response_too_large", "{error}");
    // Unannounced (read until the connection closes): cut off at the cap.
    let streamed = serve(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n".into(),
        huge,
    )
    .await;
    let error = client(streamed)
        .retrieve_payment_intent("pi_1")
        .await
        .unwrap_err();
    assert_eq!(rejected_as(&error), "response_too_large", "{error}");
}

#[tokio::test]
async fn a_list_that_repeats_a_page_stops_with_an_error() {
    let page = br#"{"object":"list","has_more":true,"data":[{"id":"pi_1","status":"succeeded","amount":1,"currency":"usd","created":1}]}"#;
    let base = serve(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            page.len()
        ),
        page.to_vec(),
    )
    .await;
    let error = tokio::time::timeout(
        Duration::from_secs(10),
        client(base).list_payment_intents(WINDOW),
    )
    .await
    .expect("the walk stops")
    .unwrap_err();
    assert_eq!(rejected_as(&error), "repeated_page", "{error}");
}

/// An API base that is not a URL is refused when the client is built, at start, instead of
/// failing every charge as unavailable.
#[test]
fn an_api_base_that_is_not_a_url_is_refused_at_start() {
    let built = StripeClient::new(&StripeConfig {
        api_base: "not a url".to_owned(),
        secret_key: Secret::new("sk_test_bounds"),
        timeout: Duration::from_secs(10),
        idempotency_window: Duration::from_secs(86_400),
        deployment_id: provider::DeploymentId::parse("test").unwrap(),
    });
    assert!(built.is_err());
}
