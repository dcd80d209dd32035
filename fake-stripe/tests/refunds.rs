//! The reconciler's side of the API over real HTTP: listing PaymentIntents by `created`, and
//! refunds with their idempotency and Stripe's refusals.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{KEY, client, create, get, pairs, parts, ride_charge, spawn};
use fake_stripe::FakeStripe;
use serde_json::Value;

async fn charge(fs: &FakeStripe, ride: &str) -> String {
    let (status, _, pi) = parts(create(fs, None, &ride_charge(ride)).await).await;
    assert_eq!(status, 200, "{pi}");
    pi["id"].as_str().unwrap().to_owned()
}

async fn refund(fs: &FakeStripe, key: Option<&str>, form: &[(&str, &str)]) -> (u16, bool, Value) {
    let mut request = client()
        .post(format!("{}/v1/refunds", fs.base_url()))
        .bearer_auth(KEY)
        .form(&pairs(form));
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    parts(request.send().await.unwrap()).await
}

fn ids(page: &Value) -> Vec<String> {
    page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pi| pi["id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn list_filters_by_created_bounds_and_pages_within_them() {
    let fs = spawn().await;
    // Five charges at t = 1000, 1001, 1002, 1003, 1004 (moved there, as a test may).
    let mut created = Vec::new();
    for i in 0..5 {
        let id = charge(&fs, &format!("ride_{i}")).await;
        assert!(fs.backdate(&id, 1000 + i));
        created.push(id);
    }
    let (status, _, page) = parts(
        get(
            &fs,
            "/v1/payment_intents?created[gte]=1001&created[lt]=1004&limit=2",
        )
        .await,
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids(&page), [created[3].clone(), created[2].clone()]);
    assert_eq!(page["has_more"], true);
    let (_, _, rest) = parts(
        get(
            &fs,
            &format!(
                "/v1/payment_intents?created[gte]=1001&created[lt]=1004&limit=2&starting_after={}",
                created[2]
            ),
        )
        .await,
    )
    .await;
    assert_eq!(ids(&rest), [created[1].clone()]);
    assert_eq!(rest["has_more"], false);

    let (_, _, open) = parts(
        get(
            &fs,
            "/v1/payment_intents?created[gt]=1001&created[lte]=1003",
        )
        .await,
    )
    .await;
    assert_eq!(ids(&open), [created[3].clone(), created[2].clone()]);

    let (status, _, body) = parts(get(&fs, "/v1/payment_intents?created[gte]=soon").await).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "created[gte]");
    assert_eq!(body["error"]["code"], "parameter_invalid_integer");
}

#[tokio::test]
async fn a_backdated_intent_moves_to_its_place_in_the_newest_first_order() {
    let fs = spawn().await;
    let first = charge(&fs, "a").await;
    let second = charge(&fs, "b").await;
    assert!(fs.backdate(&second, 10));
    let (_, _, page) = parts(get(&fs, "/v1/payment_intents").await).await;
    assert_eq!(ids(&page), [first, second]);
    assert!(!fs.backdate("pi_unknown", 10));
}

#[tokio::test]
async fn a_refund_is_made_once_per_idempotency_key_and_the_intent_stays_succeeded() {
    let fs = spawn().await;
    let pi = charge(&fs, "ride_1").await;
    let form = [
        ("payment_intent", pi.as_str()),
        ("reason", "duplicate"),
        ("metadata[finding_id]", "7"),
    ];
    let (status, replayed, first) = refund(&fs, Some("rocket-rides-refund-7"), &form).await;
    assert_eq!(status, 200, "{first}");
    assert!(!replayed);
    assert_eq!(first["object"], "refund");
    assert!(first["id"].as_str().unwrap().starts_with("re_"));
    assert_eq!(first["amount"], 2000);
    assert_eq!(first["currency"], "usd");
    assert_eq!(first["payment_intent"], pi.as_str());
    assert_eq!(first["status"], "succeeded");
    assert_eq!(first["reason"], "duplicate");
    assert_eq!(first["metadata"]["finding_id"], "7");

    let (status, replayed, again) = refund(&fs, Some("rocket-rides-refund-7"), &form).await;
    assert_eq!(status, 200);
    assert!(replayed, "the same key replays");
    assert_eq!(again, first);
    assert_eq!(
        fs.refunds().len(),
        1,
        "one refund however often it is asked"
    );

    let (_, _, intent) = parts(get(&fs, &format!("/v1/payment_intents/{pi}")).await).await;
    assert_eq!(
        intent["status"], "succeeded",
        "a refunded intent stays succeeded"
    );

    let (status, _, listed) =
        parts(get(&fs, &format!("/v1/refunds?payment_intent={pi}")).await).await;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["object"], "list");
    assert_eq!(ids(&listed), [first["id"].as_str().unwrap().to_owned()]);
    let (_, _, none) = parts(get(&fs, "/v1/refunds?payment_intent=pi_other").await).await;
    assert_eq!(ids(&none), Vec::<String>::new());
}

#[tokio::test]
async fn refunds_are_refused_as_stripe_refuses_them() {
    let fs = spawn().await;
    let pi = charge(&fs, "ride_1").await;

    let (status, _, body) = refund(&fs, None, &[("payment_intent", "pi_missing")]).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "resource_missing");
    assert_eq!(body["error"]["type"], "invalid_request_error");

    let (status, _, body) = refund(&fs, None, &[]).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "parameter_missing");

    let (status, _, body) = refund(
        &fs,
        Some("too-large"),
        &[("payment_intent", pi.as_str()), ("amount", "2001")],
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "amount_too_large");
    // A refused refund is not stored under its key: the same key with other parameters then
    // executes instead of being an idempotency error.
    let (status, _, partial) = refund(
        &fs,
        Some("too-large"),
        &[("payment_intent", pi.as_str()), ("amount", "500")],
    )
    .await;
    assert_eq!(status, 200, "{partial}");
    assert_eq!(partial["amount"], 500);
    let (status, _, rest) = refund(&fs, Some("rest"), &[("payment_intent", pi.as_str())]).await;
    assert_eq!(status, 200, "{rest}");
    assert_eq!(rest["amount"], 1500, "no amount refunds what is left");

    let (status, _, body) = refund(&fs, Some("more"), &[("payment_intent", pi.as_str())]).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "charge_already_refunded");

    let (status, _, body) = refund(
        &fs,
        Some("too-large"),
        &[("payment_intent", pi.as_str()), ("amount", "600")],
    )
    .await;
    assert_eq!(status, 400, "same key, other parameters");
    assert_eq!(body["error"]["type"], "idempotency_error");

    let (status, _, body) = refund(
        &fs,
        None,
        &[("payment_intent", pi.as_str()), ("reason", "because")],
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "reason");

    let mut declined = ride_charge("ride_2");
    declined[3].1 = "pm_card_chargeDeclined".to_owned();
    let (_, _, decline) = parts(create(&fs, None, &declined).await).await;
    let declined_pi = decline["error"]["payment_intent"]["id"].as_str().unwrap();
    let (status, _, body) = refund(&fs, None, &[("payment_intent", declined_pi)]).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "charge_not_refundable");
    assert_eq!(fs.refunds().len(), 2);
}

#[tokio::test]
async fn a_charge_key_cannot_be_reused_for_a_refund() {
    let fs = spawn().await;
    let (status, _, pi) = parts(create(&fs, Some("shared-key"), &ride_charge("r")).await).await;
    assert_eq!(status, 200);
    let (status, _, body) = refund(
        &fs,
        Some("shared-key"),
        &[("payment_intent", pi["id"].as_str().unwrap())],
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["type"], "idempotency_error");
    assert!(fs.refunds().is_empty());
}
