//! What is refused before any work: authentication errors, unknown routes and methods.

use crate::common::{KEY, client, create_with, get, parts, ride_charge, spawn};
use fake_stripe::{Config, FakeStripe};
use serde_json::json;

#[tokio::test]
async fn authentication_errors() {
    let fs = FakeStripe::spawn(Config {
        api_key: Some("sk_test_configuredsecretkey".to_owned()),
        ..Config::default()
    })
    .await
    .unwrap();
    let c = client();
    let url = format!("{}/v1/payment_intents", fs.base_url());

    let (status, _, body) = parts(c.post(&url).form(&ride_charge("r")).send().await.unwrap()).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("You did not provide an API key")
    );

    let resp = create_with(&c, &fs, "sk_test_wrongsecretabcd", None, &ride_charge("r"))
        .await
        .unwrap();
    let (status, _, body) = parts(resp).await;
    assert_eq!(status, 401);
    assert_eq!(
        body,
        json!({"error": {"type": "invalid_request_error", "message": "Invalid API Key provided: sk_test_****abcd"}})
    );

    let (status, _, _) = parts(
        c.post(&url)
            .header("Authorization", "Basic Zm9v")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 401);
    let (status, _, _) = parts(c.get(&url).send().await.unwrap()).await;
    assert_eq!(status, 401, "listing needs auth too");
    assert!(fs.payment_intents().is_empty());

    let resp = create_with(
        &c,
        &fs,
        "sk_test_configuredsecretkey",
        None,
        &ride_charge("r"),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);

    // Without a configured key, only test-mode secret keys are accepted.
    let open = spawn().await;
    let resp = create_with(&c, &open, "sk_live_realmoneyabcd", None, &ride_charge("r"))
        .await
        .unwrap();
    let (status, _, body) = parts(resp).await;
    assert_eq!(status, 401);
    assert_eq!(
        body["error"]["message"],
        "Invalid API Key provided: sk_live_****abcd"
    );
}

#[tokio::test]
async fn unknown_routes_and_methods() {
    let fs = spawn().await;
    let (status, _, body) = parts(get(&fs, "/v1/charges").await).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/charges")
    );

    let resp = client()
        .delete(format!("{}/v1/payment_intents", fs.base_url()))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers().get("allow").unwrap(), "GET, POST");
    let (status, _, body) = parts(resp).await;
    assert_eq!(status, 405);
    assert_eq!(body["error"]["type"], "invalid_request_error");
}
