//! CreateRide over gRPC → staged job → enqueuer → RabbitMQ → receipt worker → SMTP, once.

use api_server::testing::{GOOD_CARD, TestApp, new_key, ride_request};
use workers::{CancellationToken, mailer::receipt_message_id};

use crate::common::{self, TestBroker};

#[tokio::test(flavor = "multi_thread")]
async fn a_ride_is_receipted_exactly_once_end_to_end() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let shutdown = CancellationToken::new();
    let enqueuer = common::enqueuer(&app.pool, &broker, 100);
    let enqueuing = tokio::spawn(enqueuer.run(shutdown.clone()));
    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let consuming = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { worker.run(&common::amqp_url(), shutdown).await }
    });

    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    // A client retry replays the outcome and must not produce a second receipt.
    app.create_ride(&user, &key, ride_request()).await.unwrap();

    let mails = sink.wait_for(1, common::DEADLINE).await;
    assert_eq!(mails.len(), 1, "the receipt arrives");
    let mail = &mails[0];
    assert_eq!(mail.message_id(), Some(receipt_message_id(ride.id)));
    assert_eq!(mail.rcpt_to.len(), 1);
    assert!(mail.rcpt_to[0].starts_with("rider-"));
    assert!(
        mail.data.contains(&ride.charge_id),
        "the receipt names the charge"
    );
    assert!(mail.data.contains("20.00 USD"));

    shutdown.cancel();
    let enqueued = enqueuing.await.unwrap();
    let consumed = consuming.await.unwrap();
    assert_eq!(enqueued.published, 1);
    assert_eq!(consumed.sent, 1);
    assert_eq!(sink.received().len(), 1, "exactly once");
    assert!(app.staged_jobs().await.is_empty());
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
    assert_eq!(broker.depth(&broker.topology.dead_letter_queue).await, 0);
    broker.cleanup().await;
}
