//! Fault injection, idempotency-window expiry, latency and shutdown, over real HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{KEY, client, create, create_with, parts, ride_charge, spawn};
use fake_stripe::{Config, FakeStripe, FaultMode};
use serde_json::json;

#[tokio::test]
async fn error_500_executes_nothing_and_the_retry_charges_once() {
    let fs = spawn().await;
    fs.inject_faults(FaultMode::Error500, 1);
    let form = ride_charge("ride_1");
    let (status, replayed, body) = parts(create(&fs, Some("ride_1-charge"), &form).await).await;
    assert_eq!((status, replayed), (500, false));
    assert_eq!(
        body,
        json!({"error": {"type": "api_error", "message": "An unknown error occurred"}})
    );
    assert!(fs.payment_intents().is_empty());

    let (status, replayed, pi) = parts(create(&fs, Some("ride_1-charge"), &form).await).await;
    assert_eq!(
        (status, replayed),
        (200, false),
        "the 500 was not stored under the key"
    );
    assert_eq!(pi["status"], "succeeded");
    assert_eq!(fs.payment_intents().len(), 1);
    assert_eq!(fs.succeeded_charges(), 1);
    assert_eq!(fs.create_calls(), 2);
}

#[tokio::test]
async fn faults_queue_and_are_consumed_one_per_call() {
    let fs = spawn().await;
    fs.inject_faults(FaultMode::Error500, 2);
    let form = ride_charge("r");
    assert_eq!(create(&fs, None, &form).await.status(), 500);
    assert_eq!(create(&fs, None, &form).await.status(), 500);
    assert_eq!(create(&fs, None, &form).await.status(), 200);

    fs.inject_faults(FaultMode::Error500, 3);
    fs.clear_faults();
    assert_eq!(create(&fs, None, &form).await.status(), 200);
    assert_eq!(fs.payment_intents().len(), 2);
}

#[tokio::test]
async fn faults_endpoint_over_http() {
    let fs = spawn().await;
    let c = client();
    let url = format!("{}/_faults", fs.base_url());
    let resp = c
        .post(&url)
        .json(&json!({"mode": "error_500", "count": 2}))
        .send()
        .await
        .unwrap();
    let (status, _, body) = parts(resp).await;
    assert_eq!((status, body), (200, json!({"pending": 2})));
    let resp = c
        .post(&url)
        .json(&json!({"mode": "charge_then_drop", "count": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(parts(resp).await.2, json!({"pending": 3}));

    for bad in [
        r#"{"mode": "explode", "count": 1}"#,
        "not json",
        r#"{"count": 1}"#,
    ] {
        let resp = c
            .post(&url)
            .header("content-type", "application/json")
            .body(bad)
            .send()
            .await
            .unwrap();
        let (status, _, body) = parts(resp).await;
        assert_eq!(status, 400, "{bad}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }

    assert_eq!(create(&fs, None, &ride_charge("r")).await.status(), 500);
    let (status, _, body) = parts(c.delete(&url).send().await.unwrap()).await;
    assert_eq!((status, body), (200, json!({"pending": 0})));
    assert_eq!(
        create(&fs, None, &ride_charge("r")).await.status(),
        200,
        "cleared faults no longer apply"
    );
}

#[tokio::test]
async fn timeout_fault_hangs_without_charging_then_next_call_works() {
    let fs = spawn().await;
    fs.inject_faults(FaultMode::Timeout, 1);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let form = ride_charge("ride_2");
    let err = create_with(&impatient, &fs, KEY, Some("ride_2-charge"), &form)
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert!(
        fs.payment_intents().is_empty(),
        "a timeout before execution charges nothing"
    );

    let resp = create_with(&client(), &fs, KEY, Some("ride_2-charge"), &form)
        .await
        .unwrap();
    let (status, replayed, _) = parts(resp).await;
    assert_eq!((status, replayed), (200, false));
    assert_eq!(fs.succeeded_charges(), 1);
    assert_eq!(fs.create_calls(), 2);
}

#[tokio::test]
async fn charge_then_drop_charges_and_the_retry_replays_the_same_intent() {
    let fs = spawn().await;
    fs.inject_faults(FaultMode::ChargeThenDrop, 1);
    let c = client();
    let form = ride_charge("ride_3");
    let err = create_with(&c, &fs, KEY, Some("ride_3-charge"), &form)
        .await
        .unwrap_err();
    assert!(
        !err.is_timeout() && err.status().is_none(),
        "connection error, no response: {err:?}"
    );

    let ledger = fs.payment_intents();
    assert_eq!(
        ledger.len(),
        1,
        "the charge went through although the client saw an error"
    );
    assert_eq!(ledger[0].status, "succeeded");

    let (status, replayed, pi) = parts(
        create_with(&c, &fs, KEY, Some("ride_3-charge"), &form)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(pi["id"], ledger[0].id.as_str());
    assert_eq!(fs.payment_intents().len(), 1);
    assert_eq!(fs.succeeded_charges(), 1);
}

#[tokio::test]
async fn a_slow_charge_keeps_its_key_in_flight_then_replays_one_intent() {
    let fs = FakeStripe::spawn(Config {
        slow_fault_delay: Duration::from_millis(600),
        ..Config::default()
    })
    .await
    .unwrap();
    fs.inject_faults(FaultMode::Slow, 1);
    let form = ride_charge("ride_9");
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    let err = create_with(&impatient, &fs, KEY, Some("ride_9-charge"), &form)
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    // A second attempt while the first is still charging: Stripe's 409, nothing charged twice.
    let c = client();
    let (status, _, body) = parts(
        create_with(&c, &fs, KEY, Some("ride_9-charge"), &form)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 409);
    assert_eq!(body["error"]["code"], "idempotency_key_in_use");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (status, replayed, pi) = parts(
        create_with(&c, &fs, KEY, Some("ride_9-charge"), &form)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, replayed), (200, true), "the slow charge completed");
    let ledger = fs.payment_intents();
    assert_eq!(ledger.len(), 1);
    assert_eq!(pi["id"], ledger[0].id.as_str());
}

#[tokio::test]
async fn idempotency_key_expires_after_the_window() {
    let fs = FakeStripe::spawn(Config {
        idempotency_window: Duration::from_secs(1),
        ..Config::default()
    })
    .await
    .unwrap();
    let form = ride_charge("ride_4");
    let (_, _, first) = parts(create(&fs, Some("ride_4-charge"), &form).await).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, replayed, replay) = parts(create(&fs, Some("ride_4-charge"), &form).await).await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(replay["id"], first["id"]);

    // The window runs from first use, so the replay above did not extend it.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let (status, replayed, second) = parts(create(&fs, Some("ride_4-charge"), &form).await).await;
    assert_eq!((status, replayed), (200, false));
    assert_ne!(
        second["id"], first["id"],
        "an expired key creates a new PaymentIntent"
    );
    assert_eq!(fs.payment_intents().len(), 2);
    assert_eq!(fs.succeeded_charges(), 2);
}

#[tokio::test]
async fn charge_completes_even_if_the_client_gives_up_during_latency() {
    let fs = FakeStripe::spawn(Config {
        latency: Duration::from_millis(1000),
        ..Config::default()
    })
    .await
    .unwrap();
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let form = ride_charge("ride_5");
    let err = create_with(&impatient, &fs, KEY, Some("ride_5-charge"), &form)
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert!(fs.payment_intents().is_empty(), "still executing");

    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(
        fs.succeeded_charges(),
        1,
        "the provider finished the charge"
    );
    let (status, replayed, pi) = parts(create(&fs, Some("ride_5-charge"), &form).await).await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(pi["id"], fs.payment_intents()[0].id.as_str());
}

#[tokio::test]
async fn shutdown_completes_while_a_timeout_fault_holds_a_connection() {
    let fs = spawn().await;
    fs.inject_faults(FaultMode::Timeout, 1);
    let form = ride_charge("ride_6");
    let (c, url) = (client(), fs.base_url());
    let hung = tokio::spawn(async move {
        c.post(format!("{url}/v1/payment_intents"))
            .bearer_auth(KEY)
            .form(&form)
            .send()
            .await
    });
    while fs.create_calls() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::timeout(Duration::from_secs(3), fs.shutdown())
        .await
        .expect("shutdown finished promptly");

    let outcome = tokio::time::timeout(Duration::from_secs(3), hung)
        .await
        .expect("client released")
        .unwrap();
    assert!(
        outcome.is_err(),
        "the held request ends without a response: {outcome:?}"
    );
}

#[tokio::test]
async fn a_fault_aimed_at_one_customer_spares_everyone_else() {
    let fs = spawn().await;
    let c = client();
    let resp = c
        .post(format!("{}/_faults", fs.base_url()))
        .json(&json!({"mode": "error_500", "count": 2, "customer": "cus_aimed"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut aimed = ride_charge("r1");
    aimed.retain(|(name, _)| name != "customer");
    aimed.push(("customer".into(), "cus_aimed".into()));
    let other = ride_charge("r2");
    assert_eq!(create(&fs, None, &other).await.status(), 200);
    assert_eq!(create(&fs, None, &aimed).await.status(), 500);
    assert_eq!(create(&fs, None, &other).await.status(), 200);
    assert_eq!(create(&fs, None, &aimed).await.status(), 500);
    assert_eq!(create(&fs, None, &aimed).await.status(), 200, "two only");

    // A new aim replaces the pending ones; 0 clears them; untargeted faults come first.
    fs.inject_faults_for("cus_aimed", FaultMode::Error500, 5);
    fs.inject_faults_for("cus_aimed", FaultMode::Error500, 0);
    assert_eq!(create(&fs, None, &aimed).await.status(), 200);
    fs.inject_faults_for("cus_aimed", FaultMode::ChargeThenDrop, 1);
    fs.inject_faults(FaultMode::Error500, 1);
    assert_eq!(create(&fs, None, &aimed).await.status(), 500);
    assert!(
        c.post(format!("{}/v1/payment_intents", fs.base_url()))
            .bearer_auth(KEY)
            .form(&aimed)
            .send()
            .await
            .is_err(),
        "the aimed charge_then_drop"
    );
    assert_eq!(fs.payment_intents().len(), 5);
}
