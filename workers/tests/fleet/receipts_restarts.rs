//! The receipt worker across restarts: of the mail sink, and of its broker connection.

use std::time::Duration;

use api_server::testing::TestApp;
use mail_sink::MailSink;
use workers::{
    mailer::{Mailer, Receipt, receipt_message_id},
    relay_search::RelaySearch,
};

use crate::common::{self, TestBroker};
use crate::receipts::sent_count;

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_sink_still_answers_for_the_mail_it_stored() {
    let dir = std::env::temp_dir().join(format!("rides-sink-{}", uuid::Uuid::new_v4().simple()));
    let sink = MailSink::spawn("127.0.0.1:0".parse().unwrap(), Some(dir.clone()))
        .await
        .unwrap();
    let mailer = Mailer::new(
        &sink.smtp_url(),
        "receipts@rocketrides.test",
        Duration::from_secs(5),
    )
    .unwrap();
    let receipt = Receipt {
        ride_id: 7,
        to: "rider@example.com".into(),
        amount: 2000,
        currency: "usd".into(),
        charge_id: "pi_1".into(),
        ride_created_at: chrono::Utc::now(),
    };
    mailer.send(&receipt).await.unwrap();
    drop(sink);

    let restarted = MailSink::spawn("127.0.0.1:0".parse().unwrap(), Some(dir.clone()))
        .await
        .unwrap();
    let url = restarted
        .serve_search("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let search = RelaySearch::new(&url, Duration::from_secs(5)).unwrap();
    assert!(search.holds(&receipt_message_id(7)).await.unwrap());
    assert!(
        search
            .holds("ride-7.receipt@rocketrides.test")
            .await
            .unwrap()
    );
    assert!(!search.holds(&receipt_message_id(8)).await.unwrap());
    assert!(!search.holds(&receipt_message_id(77)).await.unwrap());
    let unsupported = reqwest::get(format!("{url}/api/v1/search?query=subject:receipt"))
        .await
        .unwrap();
    assert_eq!(unsupported.status(), reqwest::StatusCode::BAD_REQUEST);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The broker connection is cut at the first ack, with receipts still being mailed: the consumer
/// must notice (a reset connection's ack may never be answered), reconnect, and every receipt is
/// mailed exactly once (the redelivered ones found at the relay or in `sent_receipts`).
#[tokio::test(flavor = "multi_thread")]
async fn the_consumer_reconnects_when_its_connection_is_cut_at_an_ack() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    // As many as the worker takes at once, so that all of them are in flight together.
    let prefetch = common::receipts_config("").prefetch;
    let mut rides = Vec::new();
    for _ in 0..prefetch {
        rides.push(common::paid_ride(&app, &broker).await);
    }
    let sink = common::mail_sink().await;
    let search_url = sink
        .serve_search("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    // Every mail takes 1.5 s to be accepted, so every delivery is in flight, none acked, when the
    // queue shows them all taken; the next byte the worker then sends (its first ack) cuts every
    // connection.
    sink.accept_slowly_next(rides.len(), Duration::from_millis(1500));
    let worker = common::receipt_worker_with(&app.pool, &broker, &sink, Some(&search_url));
    let proxy = common::Proxy::spawn(common::broker_addr()).await;
    let shutdown = workers::CancellationToken::new();
    let consumer = tokio::spawn({
        let (url, shutdown) = (proxy.amqp_url(), shutdown.clone());
        async move { worker.run(&url, shutdown).await }
    });
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    while broker.depth(&broker.topology.receipts_queue).await > 0
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        sink.received().is_empty(),
        "a mail was accepted before the cut"
    );
    proxy.sever_after(0);
    while !proxy.is_severed() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(proxy.is_severed(), "the worker never acked");
    proxy.restore();

    let mails = sink.wait_for(rides.len(), common::DEADLINE).await;
    // Let a duplicate, if any, land.
    tokio::time::sleep(Duration::from_secs(1)).await;
    shutdown.cancel();
    let _ = consumer.await;
    let mut ids: Vec<String> = sink
        .received()
        .iter()
        .filter_map(|mail| mail.message_id())
        .collect();
    ids.sort();
    let mut expected: Vec<String> = rides.iter().map(|id| receipt_message_id(*id)).collect();
    expected.sort();
    assert_eq!(
        ids,
        expected,
        "every receipt mailed exactly once ({} mails)",
        mails.len()
    );
    assert_eq!(sent_count(&app).await, rides.len() as i64);
    broker.cleanup().await;
}
