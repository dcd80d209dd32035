//! Receipts handled a batch at a time: one claim statement and one record statement for several
//! deliveries, mails sent side by side over pooled SMTP connections. Each receipt keeps the
//! single path's guarantees.

use std::time::Duration;

use api_server::testing::TestApp;
use contract::message::ReceiptMessage;
use diesel::QueryDsl;
use diesel_async::RunQueryDsl;
use schema::schema::{receipt_claims, sent_receipts};
use workers::mailer::receipt_message_id;

use crate::common::{self, TestBroker};

async fn count_rows(app: &TestApp, table: &str) -> i64 {
    let mut conn = app.pool.get().await.unwrap();
    match table {
        "sent_receipts" => sent_receipts::table.count().get_result(&mut conn).await,
        _ => receipt_claims::table.count().get_result(&mut conn).await,
    }
    .unwrap()
}

fn sorted_ids(sink: &mail_sink::MailSink) -> Vec<String> {
    let mut ids: Vec<String> = sink
        .received()
        .iter()
        .filter_map(|mail| mail.message_id())
        .collect();
    ids.sort();
    ids
}

fn expected_ids(rides: &[i64]) -> Vec<String> {
    let mut ids: Vec<String> = rides.iter().map(|id| receipt_message_id(*id)).collect();
    ids.sort();
    ids
}

/// Another live attempt holds one ride's claim (a duplicate delivery on another worker): the
/// rest of the batch is mailed at once; that ride waits for the claim, then finds the other
/// attempt's record and mails nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_with_one_claim_held_elsewhere_mails_the_rest_and_that_one_once() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let mut rides = Vec::new();
    for _ in 0..4 {
        rides.push(common::paid_ride(&app, &broker).await);
    }
    let held = rides[1];
    {
        let mut conn = app.pool.get().await.unwrap();
        diesel::sql_query(
            "INSERT INTO receipt_claims (ride_id, message_id, claimed_until) \
             VALUES ($1, 'other-worker', now() + interval '1 second')",
        )
        .bind::<diesel::sql_types::BigInt, _>(held)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    // The other attempt records its send while this batch runs.
    let other = {
        let pool = app.pool.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut conn = pool.get().await.unwrap();
            diesel::sql_query(
                "WITH released AS (DELETE FROM receipt_claims WHERE ride_id = $1) \
                 INSERT INTO sent_receipts (ride_id, message_id, recorded_via) \
                 VALUES ($1, 'other-worker', 'smtp')",
            )
            .bind::<diesel::sql_types::BigInt, _>(held)
            .execute(&mut conn)
            .await
            .unwrap();
        })
    };
    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    other.await.unwrap();
    assert_eq!((summary.received, summary.sent), (4, 3));
    assert_eq!(summary.duplicates, 1);
    let mailed: Vec<i64> = rides.iter().copied().filter(|id| *id != held).collect();
    assert_eq!(sorted_ids(&sink), expected_ids(&mailed));
    assert_eq!(count_rows(&app, "sent_receipts").await, 4);
    assert_eq!(count_rows(&app, "receipt_claims").await, 0);
    broker.cleanup().await;
}

/// Poison in a batch (a body that is no receipt, a ride nobody has) goes to the dead-letter
/// queue; the batch's good receipts are mailed once.
#[tokio::test(flavor = "multi_thread")]
async fn poison_in_a_batch_is_dead_lettered_and_the_rest_mailed() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let rides = [
        common::paid_ride(&app, &broker).await,
        common::paid_ride(&app, &broker).await,
    ];
    // The two receipts with poison between them, as one batch takes them.
    let queued = broker.take_all(&broker.topology.receipts_queue).await;
    let good = ReceiptMessage::decode(&queued[0].body).unwrap();
    let unknown = ReceiptMessage {
        ride_id: 999_999,
        ..good
    };
    broker
        .publish_raw(&queued[0].message_id, &queued[0].body)
        .await;
    broker.publish_raw("poison-1", b"{not json").await;
    broker
        .publish_raw(&queued[1].message_id, &queued[1].body)
        .await;
    broker
        .publish_raw("poison-2", &unknown.encode().unwrap())
        .await;
    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!((summary.received, summary.sent), (4, 2));
    assert_eq!(summary.dead_lettered, 2);
    assert_eq!(sorted_ids(&sink), expected_ids(&rides));
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 2)
            .await,
        2
    );
    assert_eq!(count_rows(&app, "receipt_claims").await, 0);
    broker.cleanup().await;
}

/// Mails reuse the mailer's open connections; when the relay drops them, the next mails open
/// new ones and nothing is lost or sent twice.
#[tokio::test(flavor = "multi_thread")]
async fn smtp_connections_are_reused_and_replaced_when_the_relay_drops_them() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let proxy = common::Proxy::spawn(sink.addr()).await;
    let mut rides = Vec::new();
    for _ in 0..8 {
        rides.push(common::paid_ride(&app, &broker).await);
    }
    let worker = common::receipt_worker_configured(&app.pool, &broker, &sink, None, |config| {
        config.smtp_url = workers::config::Secret::new(format!("smtp://{}", proxy.addr));
        config.smtp_connections = 2;
    });
    let first = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(first.sent, 8);
    // Two conversations at once; a connection is parked again a moment after its mail, so
    // the pool may hold up to twice that.
    let opened = proxy.accepted();
    assert!(
        opened <= 4,
        "8 mails over at most 4 connections, not {opened}"
    );

    proxy.drop_connections();
    for _ in 0..4 {
        rides.push(common::paid_ride(&app, &broker).await);
    }
    let second = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!((second.sent, second.retried), (4, 0));
    assert!(proxy.accepted() > opened, "new connections after the drop");
    assert_eq!(sorted_ids(&sink), expected_ids(&rides));
    assert_eq!(count_rows(&app, "sent_receipts").await, 12);
    broker.cleanup().await;
}
