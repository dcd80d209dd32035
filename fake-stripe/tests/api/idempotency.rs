//! Idempotency keys: a replay of the same parameters, other parameters refused, keys scoped per
//! API key, and a concurrent request with the same key refused with 409.

use std::time::Duration;

use crate::common::{KEY, client, create, create_with, parts, ride_charge, spawn};
use fake_stripe::{Config, FakeStripe};
use serde_json::json;

#[tokio::test]
async fn same_key_same_params_replays_the_exact_response() {
    let fs = spawn().await;
    let form = ride_charge("ride_1");
    let first = create(&fs, Some("ride_1-charge"), &form).await;
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_body = first.bytes().await.unwrap();

    // Same parameters in a different order are the same request.
    let mut reordered = form.clone();
    reordered.reverse();
    let second = create(&fs, Some("ride_1-charge"), &reordered).await;
    assert_eq!(second.status(), 200);
    assert_eq!(second.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(
        second.bytes().await.unwrap(),
        first_body,
        "byte-identical replay"
    );

    assert_eq!(fs.payment_intents().len(), 1, "no second PaymentIntent");
    assert_eq!(fs.succeeded_charges(), 1);
    assert_eq!(fs.create_calls(), 2);
}

#[tokio::test]
async fn same_key_different_params_is_an_idempotency_error() {
    let fs = spawn().await;
    let (status, _, _) = parts(create(&fs, Some("k1"), &ride_charge("ride_1")).await).await;
    assert_eq!(status, 200);
    let mut changed = ride_charge("ride_1");
    changed[0].1 = "2500".to_owned();
    let (status, replayed, body) = parts(create(&fs, Some("k1"), &changed).await).await;
    assert_eq!(status, 400);
    assert!(!replayed);
    assert_eq!(
        body,
        json!({"error": {"type": "idempotency_error", "message":
            "Keys for idempotent requests can only be used with the same parameters they were first used with. \
             Try using a key other than 'k1' if you meant to execute a different request."}})
    );
    // Adding a parameter is also a different request.
    let mut extended = ride_charge("ride_1");
    extended.push(("metadata[extra]".to_owned(), "x".to_owned()));
    let (status, _, body) = parts(create(&fs, Some("k1"), &extended).await).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "idempotency_error");
    assert_eq!(fs.payment_intents().len(), 1);
}

#[tokio::test]
async fn idempotency_keys_are_scoped_per_api_key() {
    let fs = spawn().await;
    let c = client();
    let form = ride_charge("ride_1");
    let a = create_with(&c, &fs, "sk_test_accountA", Some("shared"), &form)
        .await
        .unwrap();
    let b = create_with(&c, &fs, "sk_test_accountB", Some("shared"), &form)
        .await
        .unwrap();
    let (a, b) = (parts(a).await, parts(b).await);
    assert_eq!((a.0, a.1, b.0, b.1), (200, false, 200, false));
    assert_ne!(a.2["id"], b.2["id"]);
    assert_eq!(fs.payment_intents().len(), 2);
}

#[tokio::test]
async fn concurrent_request_with_same_key_gets_409() {
    let fs = FakeStripe::spawn(Config {
        latency: Duration::from_millis(1500),
        ..Config::default()
    })
    .await
    .unwrap();
    let form = ride_charge("ride_9");
    let c = client();
    let first = {
        let (c, form, url) = (c.clone(), form.clone(), fs.base_url());
        tokio::spawn(async move {
            c.post(format!("{url}/v1/payment_intents"))
                .bearer_auth(KEY)
                .header("Idempotency-Key", "ride_9-charge")
                .form(&form)
                .send()
                .await
                .unwrap()
        })
    };
    // Wait until the first request is being executed (it sleeps for the latency).
    while fs.create_calls() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _, body) = parts(
        create_with(&c, &fs, KEY, Some("ride_9-charge"), &form)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["type"], "idempotency_error");
    assert_eq!(body["error"]["code"], "idempotency_key_in_use");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("ride_9-charge")
    );

    let (status, replayed, pi) = parts(first.await.unwrap()).await;
    assert_eq!((status, replayed), (200, false));
    // Once the first finished, the key replays.
    let (status, replayed, again) = parts(
        create_with(&c, &fs, KEY, Some("ride_9-charge"), &form)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(again["id"], pi["id"]);
    assert_eq!(fs.payment_intents().len(), 1);
    assert_eq!(fs.create_calls(), 3);
}
