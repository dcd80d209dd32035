//! The receipt worker against a real SMTP conversation with the in-test mail sink.

use api_server::testing::{GOOD_CARD, TestApp, new_key, ride_request};
use diesel::QueryDsl;
use diesel_async::RunQueryDsl;
use schema::schema::sent_receipts;
use workers::{mailer::receipt_message_id, message::ReceiptMessage};

use crate::common::{self, TestBroker};

/// A paid ride whose receipt message is in the broker's receipts queue; returns its id.
async fn paid_ride(app: &TestApp, broker: &TestBroker) -> i64 {
    let user = app.create_user(GOOD_CARD).await;
    let response = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap()
        .into_inner();
    let summary = common::enqueuer(&app.pool, broker, 100)
        .run_once()
        .await
        .unwrap();
    assert_eq!(summary.published, 1);
    response.ride.unwrap().id
}

async fn sent_count(app: &TestApp) -> i64 {
    let mut conn = app.pool.get().await.unwrap();
    sent_receipts::table
        .count()
        .get_result(&mut conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redelivered_receipt_is_mailed_once() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let ride_id = paid_ride(&app, &broker).await;
    // The same message again, as after a redelivery or an enqueuer republishing a job whose
    // deletion did not commit.
    let original = broker.take_all(&broker.topology.receipts_queue).await;
    assert_eq!(original.len(), 1);
    broker
        .publish_raw(&original[0].message_id, &original[0].body)
        .await;
    broker
        .publish_raw(&original[0].message_id, &original[0].body)
        .await;

    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(summary.received, 2);
    assert_eq!(summary.sent, 1);
    assert_eq!(summary.duplicates, 1);
    // A later pass over yet another copy changes nothing either.
    broker
        .publish_raw(&original[0].message_id, &original[0].body)
        .await;
    let again = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!((again.sent, again.duplicates), (0, 1));

    let mails = sink.received();
    assert_eq!(mails.len(), 1);
    assert_eq!(mails[0].message_id(), Some(receipt_message_id(ride_id)));
    assert_eq!(sent_count(&app).await, 1);
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
    assert_eq!(broker.depth(&broker.topology.dead_letter_queue).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn poison_messages_are_dead_lettered_not_retried() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let ride_id = paid_ride(&app, &broker).await;
    let valid =
        ReceiptMessage::decode(&broker.take_all(&broker.topology.receipts_queue).await[0].body)
            .unwrap();
    let mut future_version = serde_json::to_value(&valid).unwrap();
    future_version["version"] = serde_json::json!(2);
    let mut unknown_ride = valid.clone();
    unknown_ride.ride_id = ride_id + 1000;
    let mut someone_elses = valid.clone();
    someone_elses.user_id += 1000;
    broker.publish_raw("p1", b"{not json").await;
    broker
        .publish_raw("p2", future_version.to_string().as_bytes())
        .await;
    broker
        .publish_raw("p3", &unknown_ride.encode().unwrap())
        .await;
    broker
        .publish_raw("p4", &someone_elses.encode().unwrap())
        .await;

    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(summary.received, 4);
    assert_eq!(summary.dead_lettered, 4);
    assert_eq!(summary.sent, 0);
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 4)
            .await,
        4
    );
    let dead: Vec<String> = broker
        .take_all(&broker.topology.dead_letter_queue)
        .await
        .into_iter()
        .map(|t| t.message_id)
        .collect();
    assert_eq!(dead.len(), 4);
    for id in ["p1", "p2", "p3", "p4"] {
        assert!(dead.iter().any(|d| d == id), "{id} not dead-lettered");
    }
    assert!(sink.received().is_empty());
    assert_eq!(sent_count(&app).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_temporary_smtp_failure_is_retried_then_delivered_once() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let ride_id = paid_ride(&app, &broker).await;
    sink.fail_next(2, 451);

    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(summary.retried, 2);
    assert_eq!(summary.sent, 1);
    let mails = sink.received();
    assert_eq!(mails.len(), 1);
    assert_eq!(mails[0].message_id(), Some(receipt_message_id(ride_id)));
    assert_eq!(sent_count(&app).await, 1);
    assert_eq!(broker.depth(&broker.topology.dead_letter_queue).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn smtp_down_is_temporary_and_the_delivery_limit_dead_letters_eventually() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::with_delivery_limit(2).await;
    let sink = common::mail_sink().await;
    paid_ride(&app, &broker).await;
    // Every attempt fails temporarily: bounded by the quorum queue's delivery limit.
    sink.fail_next(100, 421);
    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(summary.sent, 0);
    assert!(summary.retried >= 2, "{summary:?}");
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 1)
            .await,
        1
    );
    assert_eq!(sent_count(&app).await, 0, "a failed send records nothing");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_permanent_smtp_failure_is_dead_lettered() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    paid_ride(&app, &broker).await;
    sink.fail_next(1, 550);
    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(
        (summary.dead_lettered, summary.sent, summary.retried),
        (1, 0, 0)
    );
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 1)
            .await,
        1
    );
    assert_eq!(sent_count(&app).await, 0);
    broker.cleanup().await;
}
