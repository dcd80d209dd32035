//! PaymentIntents API behaviour over real HTTP: shapes, idempotency, declines, validation,
//! auth, listing and search.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{KEY, client, create, create_with, get, pairs, parts, ride_charge, spawn};
use fake_stripe::{Config, FakeStripe};
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

#[tokio::test]
async fn list_paginates_newest_first() {
    let fs = spawn().await;
    let mut created = Vec::new();
    for i in 0..25 {
        let (status, _, pi) =
            parts(create(&fs, None, &ride_charge(&format!("ride_{i}"))).await).await;
        assert_eq!(status, 200);
        created.push(pi["id"].as_str().unwrap().to_owned());
    }
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &cursor {
            Some(after) => format!("/v1/payment_intents?limit=10&starting_after={after}"),
            None => "/v1/payment_intents?limit=10".to_owned(),
        };
        let (status, _, page) = parts(get(&fs, &path).await).await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(page["object"], "list");
        assert_eq!(page["url"], "/v1/payment_intents");
        let data = page["data"].as_array().unwrap();
        pages += 1;
        let expected_len = [10, 10, 5][pages - 1];
        assert_eq!(data.len(), expected_len);
        assert_eq!(page["has_more"], pages < 3);
        seen.extend(data.iter().map(|pi| pi["id"].as_str().unwrap().to_owned()));
        if page["has_more"] == false {
            break;
        }
        cursor = seen.last().cloned();
    }
    let mut newest_first = created.clone();
    newest_first.reverse();
    assert_eq!(seen, newest_first, "every PI exactly once, newest first");

    let (_, _, default_page) = parts(get(&fs, "/v1/payment_intents").await).await;
    assert_eq!(
        default_page["data"].as_array().unwrap().len(),
        10,
        "default limit is 10"
    );

    for bad in ["0", "101", "ten"] {
        let (status, _, body) =
            parts(get(&fs, &format!("/v1/payment_intents?limit={bad}")).await).await;
        assert_eq!(status, 400, "limit={bad}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "limit");
    }
    let (status, _, body) =
        parts(get(&fs, "/v1/payment_intents?starting_after=pi_unknown").await).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "resource_missing");
}

#[tokio::test]
async fn list_filters_by_customer_and_includes_declines() {
    let fs = spawn().await;
    let mut declined = ride_charge("r1");
    declined[3].1 = "pm_card_chargeDeclined".to_owned();
    assert_eq!(create(&fs, None, &declined).await.status(), 402);
    let mut other = ride_charge("r2");
    other[2].1 = "cus_other".to_owned();
    assert_eq!(create(&fs, None, &other).await.status(), 200);
    assert_eq!(create(&fs, None, &ride_charge("r3")).await.status(), 200);

    let (_, _, all) = parts(get(&fs, "/v1/payment_intents").await).await;
    let statuses: Vec<&str> = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["status"].as_str().unwrap())
        .collect();
    assert_eq!(
        statuses,
        ["succeeded", "succeeded", "requires_payment_method"]
    );

    let (_, _, mine) = parts(get(&fs, "/v1/payment_intents?customer=cus_rider1").await).await;
    let rides: Vec<&str> = mine["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["metadata"]["ride_id"].as_str().unwrap())
        .collect();
    assert_eq!(rides, ["r3", "r1"]);
    assert_eq!(mine["has_more"], false);
}

#[tokio::test]
async fn search_by_metadata_and_status() {
    let fs = spawn().await;
    for ride in ["123", "456", "123"] {
        assert_eq!(create(&fs, None, &ride_charge(ride)).await.status(), 200);
    }
    let mut declined = ride_charge("123");
    declined[3].1 = "pm_card_chargeDeclined".to_owned();
    assert_eq!(create(&fs, None, &declined).await.status(), 402);

    let search = |q: &str| {
        let url = format!("{}/v1/payment_intents/search", fs.base_url());
        client()
            .get(url)
            .bearer_auth(KEY)
            .query(&[("query", q.to_owned())])
            .send()
    };
    let (status, _, body) = parts(search("metadata['ride_id']:'123'").await.unwrap()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "search_result");
    assert_eq!(body["url"], "/v1/payment_intents/search");
    assert_eq!(body["has_more"], false);
    assert_eq!(body["next_page"], Value::Null);
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert!(data.iter().all(|pi| pi["metadata"]["ride_id"] == "123"));

    let (_, _, body) = parts(
        search("metadata['ride_id']:'123' AND status:'succeeded'")
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    let (_, _, body) = parts(search("metadata['ride_id']:'999'").await.unwrap()).await;
    assert_eq!(body["data"], json!([]));

    for bad in [
        "amount>100",
        "metadata['ride_id']:'123' OR status:'succeeded'",
        "customer:'cus_rider1'",
    ] {
        let (status, _, body) = parts(search(bad).await.unwrap()).await;
        assert_eq!(status, 400, "{bad}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}

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
