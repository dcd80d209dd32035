//! Creating and confirming a PaymentIntent: Stripe's shapes, an unconfirmed intent, declines with
//! their codes, and validation errors that are not stored under the key.

use crate::common::{create, get, pairs, parts, ride_charge, spawn};
use serde_json::{Value, json};

fn is_stripe_id(value: &Value, prefix: &str) -> bool {
    let s = value.as_str().unwrap_or("");
    s.len() == prefix.len() + 24
        && s.starts_with(prefix)
        && s[prefix.len()..].chars().all(|c| c.is_ascii_alphanumeric())
}

#[tokio::test]
async fn successful_charge_has_stripe_shape_and_is_retrievable() {
    let fs = spawn().await;
    let before = chrono::Utc::now().timestamp();
    let resp = create(&fs, None, &ride_charge("ride_42")).await;
    let request_id = resp
        .headers()
        .get("request-id")
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        request_id.starts_with("req_") && request_id.len() > 4,
        "{request_id}"
    );
    let (status, replayed, pi) = parts(resp).await;
    assert_eq!(status, 200, "{pi}");
    assert!(!replayed);
    assert!(is_stripe_id(&pi["id"], "pi_"), "{pi}");
    assert!(is_stripe_id(&pi["latest_charge"], "ch_"), "{pi}");
    assert_eq!(pi["object"], "payment_intent");
    assert_eq!(pi["amount"], 2000);
    assert_eq!(pi["amount_received"], 2000);
    assert_eq!(pi["currency"], "usd");
    assert_eq!(pi["customer"], "cus_rider1");
    assert_eq!(pi["payment_method"], "pm_card_visa");
    assert_eq!(pi["description"], "Rocket ride");
    assert_eq!(pi["metadata"], json!({"ride_id": "ride_42"}));
    assert_eq!(pi["status"], "succeeded");
    assert_eq!(pi["confirmation_method"], "automatic");
    assert_eq!(pi["livemode"], false);
    let created = pi["created"].as_i64().unwrap();
    assert!(created >= before && created <= chrono::Utc::now().timestamp());

    let ledger = fs.payment_intents();
    assert_eq!(ledger.len(), 1);
    assert_eq!(
        serde_json::to_value(&ledger[0]).unwrap(),
        pi,
        "ledger holds what was answered"
    );
    assert_eq!(fs.succeeded_charges(), 1);
    assert_eq!(fs.create_calls(), 1);

    let (status, _, fetched) = parts(
        get(
            &fs,
            &format!("/v1/payment_intents/{}", pi["id"].as_str().unwrap()),
        )
        .await,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(fetched, pi);

    let (status, _, missing) = parts(get(&fs, "/v1/payment_intents/pi_nope").await).await;
    assert_eq!(status, 404);
    assert_eq!(
        missing,
        json!({"error": {"type": "invalid_request_error", "code": "resource_missing", "param": "intent",
                          "message": "No such payment_intent: 'pi_nope'"}})
    );
}

#[tokio::test]
async fn unconfirmed_intent_is_created_but_not_charged() {
    let fs = spawn().await;
    let (status, _, pi) = parts(
        create(
            &fs,
            None,
            &pairs(&[
                ("amount", "500"),
                ("currency", "EUR"),
                ("payment_method", "pm_card_visa"),
            ]),
        )
        .await,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(pi["status"], "requires_confirmation");
    assert_eq!(
        pi["currency"], "eur",
        "currency is normalised to lower case"
    );
    assert_eq!(pi["amount_received"], 0);
    assert_eq!(pi["latest_charge"], Value::Null);
    assert_eq!(fs.payment_intents().len(), 1);
    assert_eq!(fs.succeeded_charges(), 0);
}

#[tokio::test]
async fn declined_card_is_402_recorded_and_replayed() {
    let fs = spawn().await;
    let mut form = ride_charge("ride_7");
    form[3].1 = "pm_card_chargeDeclined".to_owned();
    let first = create(&fs, Some("ride_7-charge"), &form).await;
    let first_body = first.bytes().await.unwrap();
    let body: Value = serde_json::from_slice(&first_body).unwrap();
    let err = &body["error"];
    assert_eq!(err["type"], "card_error");
    assert_eq!(err["code"], "card_declined");
    assert_eq!(err["decline_code"], "generic_decline");
    assert_eq!(err["message"], "Your card was declined.");
    let pi = &err["payment_intent"];
    assert!(is_stripe_id(&pi["id"], "pi_"));
    assert_eq!(pi["status"], "requires_payment_method");
    assert_eq!(pi["amount_received"], 0);
    assert_eq!(pi["metadata"]["ride_id"], "ride_7");

    let ledger = fs.payment_intents();
    assert_eq!(ledger.len(), 1, "the declined PaymentIntent is recorded");
    assert_eq!(ledger[0].id, pi["id"].as_str().unwrap());
    assert_eq!(ledger[0].status, "requires_payment_method");
    assert_eq!(fs.succeeded_charges(), 0);

    let replay = create(&fs, Some("ride_7-charge"), &form).await;
    assert_eq!(replay.status(), 402);
    assert_eq!(replay.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(replay.bytes().await.unwrap(), first_body);
    assert_eq!(fs.payment_intents().len(), 1);

    // The declined intent is visible through the API too.
    let (status, _, fetched) =
        parts(get(&fs, &format!("/v1/payment_intents/{}", ledger[0].id)).await).await;
    assert_eq!(status, 200);
    assert_eq!(fetched["status"], "requires_payment_method");
}

#[tokio::test]
async fn insufficient_funds_card_declines_with_its_decline_code() {
    let fs = spawn().await;
    let mut form = ride_charge("r");
    form[3].1 = "pm_card_chargeDeclinedInsufficientFunds".to_owned();
    let (status, _, body) = parts(create(&fs, None, &form).await).await;
    assert_eq!(status, 402);
    assert_eq!(body["error"]["decline_code"], "insufficient_funds");
}

#[tokio::test]
async fn validation_errors_are_400_and_not_stored_under_the_key() {
    let fs = spawn().await;
    let cases = [
        (pairs(&[("currency", "usd")]), "parameter_missing", "amount"),
        (
            pairs(&[("amount", "abc"), ("currency", "usd")]),
            "parameter_invalid_integer",
            "amount",
        ),
        (
            pairs(&[("amount", "-5"), ("currency", "usd")]),
            "parameter_invalid_integer",
            "amount",
        ),
        (
            pairs(&[("amount", "0"), ("currency", "usd")]),
            "parameter_invalid_integer",
            "amount",
        ),
        (pairs(&[("amount", "100")]), "parameter_missing", "currency"),
        (
            pairs(&[("amount", "100"), ("currency", "usd"), ("confirm", "true")]),
            "parameter_missing",
            "payment_method",
        ),
        (
            pairs(&[("amount", "100"), ("currency", "usd"), ("amout", "1")]),
            "parameter_unknown",
            "amout",
        ),
        (
            pairs(&[("amount", ""), ("currency", "usd")]),
            "parameter_invalid_empty",
            "amount",
        ),
    ];
    for (form, code, param) in cases {
        let (status, _, body) = parts(create(&fs, None, &form).await).await;
        assert_eq!(status, 400, "{form:?} -> {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(body["error"]["code"], code, "{form:?} -> {body}");
        assert_eq!(body["error"]["param"], param, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    let (status, _, body) = parts(
        create(
            &fs,
            None,
            &pairs(&[("amount", "100"), ("currency", "dollars")]),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (400, Some("currency"))
    );
    assert!(fs.payment_intents().is_empty());

    // An invalid request does not burn the key: fixing the request with the same key executes.
    let (status, _, _) =
        parts(create(&fs, Some("fix-me"), &pairs(&[("currency", "usd")])).await).await;
    assert_eq!(status, 400);
    let (status, replayed, pi) = parts(create(&fs, Some("fix-me"), &ride_charge("r1")).await).await;
    assert_eq!((status, replayed), (200, false), "{pi}");
    assert_eq!(fs.payment_intents().len(), 1);
}
