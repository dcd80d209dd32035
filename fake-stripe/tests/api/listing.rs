//! Listing and search: pages newest first, filters by customer with declines included, and the
//! search by metadata and status.

use crate::common::{KEY, client, create, get, parts, ride_charge, spawn};
use serde_json::{Value, json};

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
