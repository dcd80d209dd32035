//! The ledger calls against fake-stripe over real HTTP: a window listed across pages, a missing
//! PaymentIntent, and a refund made once per idempotency key.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use fake_stripe::{Config, FakeStripe};
use provider::{CreatedWindow, RefundRequest, Secret, StripeClient, StripeConfig};

const KEY: &str = "sk_test_provider_tests";

fn client(fs: &FakeStripe) -> StripeClient {
    StripeClient::new(&StripeConfig {
        api_base: fs.base_url(),
        secret_key: Secret::new(KEY),
        timeout: Duration::from_secs(5),
        idempotency_window: Duration::from_secs(86_400),
        deployment_id: provider::DeploymentId::parse("test").unwrap(),
    })
    .unwrap()
}

async fn charge(fs: &FakeStripe, ride: usize) -> String {
    let form = [
        ("amount", "2000".to_owned()),
        ("currency", "usd".to_owned()),
        ("payment_method", "pm_card_visa".to_owned()),
        ("confirm", "true".to_owned()),
        ("metadata[ride_id]", ride.to_string()),
    ];
    let body: serde_json::Value = reqwest::Client::new()
        .post(format!("{}/v1/payment_intents", fs.base_url()))
        .bearer_auth(KEY)
        .form(&form)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    body["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_window_is_listed_whole_across_pages_and_nothing_outside_it() {
    let fs = FakeStripe::spawn(Config::default()).await.unwrap();
    let mut inside = Vec::new();
    // 230 charges at t = 5000 (three pages), and one on each side of the window.
    for ride in 0..230 {
        let id = charge(&fs, ride).await;
        assert!(fs.backdate(&id, 5000));
        inside.push(id);
    }
    let before = charge(&fs, 1000).await;
    assert!(fs.backdate(&before, 4999));
    let after = charge(&fs, 1001).await;
    assert!(fs.backdate(&after, 5001));

    let listed = client(&fs)
        .list_payment_intents(CreatedWindow {
            from: 5000,
            until: 5001,
        })
        .await
        .unwrap();
    let mut ids: Vec<String> = listed.iter().map(|intent| intent.id.clone()).collect();
    assert_eq!(ids.len(), 230, "every one, once");
    ids.sort();
    inside.sort();
    assert_eq!(ids, inside);
    assert!(listed.iter().all(|intent| intent.created == 5000));
    assert_eq!(
        listed[0].metadata.get("ride_id").map(String::as_str),
        Some("229")
    );
}

#[tokio::test]
async fn a_missing_intent_is_none_and_so_is_an_id_that_cannot_be_one() {
    let fs = FakeStripe::spawn(Config::default()).await.unwrap();
    let stripe = client(&fs);
    assert_eq!(
        stripe.retrieve_payment_intent("pi_nothing").await.unwrap(),
        None
    );
    let id = charge(&fs, 1).await;
    let found = stripe.retrieve_payment_intent(&id).await.unwrap().unwrap();
    assert_eq!((found.status.as_str(), found.amount), ("succeeded", 2000));
    // Not sent (it would name another route): no PaymentIntent has such an id.
    assert_eq!(
        stripe
            .retrieve_payment_intent("pi_x/../../v1/refunds")
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn a_refund_is_made_once_per_key_and_a_second_one_is_refused_as_already_refunded() {
    let fs = FakeStripe::spawn(Config::default()).await.unwrap();
    let stripe = client(&fs);
    let id = charge(&fs, 1).await;
    let request = RefundRequest {
        payment_intent: id.clone(),
        reason: "duplicate",
        metadata: vec![("finding_id", "9".to_owned())],
        idempotency_key: "rocket-rides-refund-9".to_owned(),
    };
    let first = stripe.refund(&request).await.unwrap();
    let again = stripe.refund(&request).await.unwrap();
    assert_eq!(first, again, "the same key gives the same refund back");
    assert_eq!(fs.refunds().len(), 1);
    assert_eq!(stripe.list_refunds(&id).await.unwrap(), [first]);

    let other_key = RefundRequest {
        idempotency_key: "rocket-rides-refund-10".to_owned(),
        ..request
    };
    let refused = stripe.refund(&other_key).await.unwrap_err();
    assert_eq!(refused.code(), Some("charge_already_refunded"), "{refused}");
    assert_eq!(fs.refunds().len(), 1);
}

#[tokio::test]
async fn every_refund_of_a_payment_intent_is_listed_across_pages_with_its_metadata() {
    let fs = FakeStripe::spawn(Config::default()).await.unwrap();
    let stripe = client(&fs);
    let id = charge(&fs, 1).await;
    // 130 partial refunds of 1 cent (two pages of 100), each naming its number.
    for n in 0..130 {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/refunds", fs.base_url()))
            .bearer_auth(KEY)
            .header("Idempotency-Key", format!("partial-{n}"))
            .form(&[
                ("payment_intent", id.clone()),
                ("amount", "1".to_owned()),
                ("metadata[n]", n.to_string()),
            ])
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
    }

    let refunds = stripe.list_refunds(&id).await.unwrap();
    assert_eq!(refunds.len(), 130);
    let mut numbers: Vec<u32> = refunds
        .iter()
        .map(|refund| refund.metadata["n"].parse().unwrap())
        .collect();
    numbers.sort_unstable();
    assert_eq!(numbers, (0..130).collect::<Vec<_>>(), "each refund once");
}

#[tokio::test]
async fn listed_and_retrieved_intents_say_how_much_of_their_charge_was_refunded() {
    let fs = FakeStripe::spawn(Config::default()).await.unwrap();
    let stripe = client(&fs);
    let id = charge(&fs, 1).await;
    assert!(fs.backdate(&id, 5000));
    let window = CreatedWindow {
        from: 5000,
        until: 5001,
    };
    let listed = stripe.list_payment_intents(window).await.unwrap();
    assert_eq!(listed[0].amount_refunded(), Some(0));
    stripe
        .refund(&RefundRequest {
            payment_intent: id.clone(),
            reason: "duplicate",
            metadata: vec![],
            idempotency_key: "refund-listed".to_owned(),
        })
        .await
        .unwrap();
    let listed = stripe.list_payment_intents(window).await.unwrap();
    let amount = listed[0].amount;
    assert_eq!(listed[0].amount_refunded(), Some(amount));
    let retrieved = stripe.retrieve_payment_intent(&id).await.unwrap().unwrap();
    assert_eq!(retrieved.amount_refunded(), Some(amount));
    assert_eq!(retrieved.customer, None, "this charge names no customer");
}
