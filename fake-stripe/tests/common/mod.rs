//! Shared helpers for the integration tests: a client that speaks to the fake exactly as
//! our Stripe client does (Bearer auth, form-encoded body, optional Idempotency-Key).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use fake_stripe::{Config, FakeStripe};
use serde_json::Value;

pub const KEY: &str = "sk_test_rocketrides0001";

pub async fn spawn() -> FakeStripe {
    FakeStripe::spawn(Config::default())
        .await
        .expect("spawn fake-stripe")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// The form our api-server sends for an off-session ride charge.
pub fn ride_charge(ride_id: &str) -> Vec<(String, String)> {
    [
        ("amount", "2000"),
        ("currency", "usd"),
        ("customer", "cus_rider1"),
        ("payment_method", "pm_card_visa"),
        ("confirm", "true"),
        ("off_session", "true"),
        ("description", "Rocket ride"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .chain([("metadata[ride_id]".to_owned(), ride_id.to_owned())])
    .collect()
}

pub async fn create_with(
    client: &reqwest::Client,
    fs: &FakeStripe,
    api_key: &str,
    idempotency_key: Option<&str>,
    form: &[(String, String)],
) -> reqwest::Result<reqwest::Response> {
    let mut req = client
        .post(format!("{}/v1/payment_intents", fs.base_url()))
        .bearer_auth(api_key)
        .form(form);
    if let Some(key) = idempotency_key {
        req = req.header("Idempotency-Key", key);
    }
    req.send().await
}

pub async fn create(
    fs: &FakeStripe,
    idempotency_key: Option<&str>,
    form: &[(String, String)],
) -> reqwest::Response {
    create_with(&client(), fs, KEY, idempotency_key, form)
        .await
        .expect("request sent")
}

pub async fn get(fs: &FakeStripe, path_and_query: &str) -> reqwest::Response {
    client()
        .get(format!("{}{path_and_query}", fs.base_url()))
        .bearer_auth(KEY)
        .send()
        .await
        .expect("request sent")
}

/// Status, whether the response was an idempotent replay, and the JSON body.
pub async fn parts(resp: reqwest::Response) -> (u16, bool, Value) {
    let status = resp.status().as_u16();
    let replayed = resp
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(
        resp.headers().get("content-type").unwrap(),
        "application/json",
        "every response is JSON"
    );
    let body: Value = resp.json().await.expect("JSON body");
    (status, replayed.as_deref() == Some("true"), body)
}

pub fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}
