//! The receipt worker against a real SMTP conversation with the in-test mail sink.

use std::time::Duration;

use api_server::testing::TestApp;
use contract::message::ReceiptMessage;
use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::RunQueryDsl;
use mail_sink::MailSink;
use schema::schema::{receipt_claims, sent_receipts};
use workers::mailer::{Mailer, Receipt, receipt_message_id};

use crate::common::{self, TestBroker};

pub(crate) async fn sent_count(app: &TestApp) -> i64 {
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
    let ride_id = common::paid_ride(&app, &broker).await;
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
    let ride_id = common::paid_ride(&app, &broker).await;
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
async fn a_receipt_for_a_ride_without_its_recorded_charge_is_dead_lettered_not_mailed() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let ride_id = common::paid_ride(&app, &broker).await;
    let valid =
        ReceiptMessage::decode(&broker.take_all(&broker.topology.receipts_queue).await[0].body)
            .unwrap();
    // Another charge id than the ride records (a forged or stale message).
    let mut other_charge = valid.clone();
    other_charge.charge_id = "pi_not_this_rides".to_owned();
    broker
        .publish_raw("c1", &other_charge.encode().unwrap())
        .await;
    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!((summary.received, summary.dead_lettered), (1, 1));

    // The ride's charge is not recorded (never, or no longer): its own message is refused too.
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(format!(
        "UPDATE rides SET stripe_charge_id = NULL WHERE id = {ride_id}"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    broker.publish_raw("c2", &valid.encode().unwrap()).await;
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!((summary.received, summary.dead_lettered), (1, 1));
    assert_eq!(summary.sent, 0);
    let dead: Vec<String> = broker
        .take_all(&broker.topology.dead_letter_queue)
        .await
        .into_iter()
        .map(|t| t.message_id)
        .collect();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(sink.received().is_empty(), "nothing mailed");
    assert_eq!(sent_count(&app).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_temporary_smtp_failure_is_retried_then_delivered_once() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let ride_id = common::paid_ride(&app, &broker).await;
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
    common::paid_ride(&app, &broker).await;
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
    common::paid_ride(&app, &broker).await;
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

/// The state a receipt worker leaves when it dies between the relay's `250` and its commit
/// (`mailed`), or between committing its claim and sending (`!mailed`): an unrecorded claim whose
/// lease `lease_left` from now (negative: already lapsed).
async fn leave_crashed_claim(
    app: &TestApp,
    sink: &MailSink,
    ride_id: i64,
    mailed: bool,
    lease_left_secs: f64,
) {
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(
        "INSERT INTO receipt_claims (ride_id, message_id, claimed_until) \
         VALUES ($1, 'crashed-attempt', now() + make_interval(secs => $2))",
    )
    .bind::<diesel::sql_types::BigInt, _>(ride_id)
    .bind::<diesel::sql_types::Double, _>(lease_left_secs)
    .execute(&mut conn)
    .await
    .unwrap();
    if mailed {
        let mailer = Mailer::new(
            &sink.smtp_url(),
            "receipts@rocketrides.test",
            Duration::from_secs(5),
        )
        .unwrap();
        mailer
            .send(&Receipt {
                ride_id,
                to: "rider@example.com".into(),
                amount: 2000,
                currency: "usd".into(),
                charge_id: "pi_crashed".into(),
                ride_created_at: chrono::Utc::now(),
            })
            .await
            .unwrap();
    }
}

/// A paid ride whose receipt message is queued, the sink, and a receipt worker that asks the
/// sink's message search (or has none).
struct Scene {
    app: TestApp,
    broker: TestBroker,
    sink: MailSink,
    ride_id: i64,
    worker: std::sync::Arc<workers::receipts::ReceiptWorker>,
}

async fn scene(with_search: bool) -> Scene {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let search = match with_search {
        true => Some(
            sink.serve_search("127.0.0.1:0".parse().unwrap())
                .await
                .unwrap(),
        ),
        false => None,
    };
    let ride_id = common::paid_ride(&app, &broker).await;
    let worker = common::receipt_worker_with(&app.pool, &broker, &sink, search.as_deref());
    Scene {
        app,
        broker,
        sink,
        ride_id,
        worker,
    }
}

async fn claims_left(app: &TestApp) -> i64 {
    let mut conn = app.pool.get().await.unwrap();
    receipt_claims::table
        .count()
        .get_result(&mut conn)
        .await
        .unwrap()
}

async fn recorded_via(app: &TestApp, ride_id: i64) -> String {
    let mut conn = app.pool.get().await.unwrap();
    sent_receipts::table
        .filter(sent_receipts::ride_id.eq(ride_id))
        .select(sent_receipts::recorded_via)
        .first(&mut conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_receipt_mailed_by_a_crashed_attempt_is_found_at_the_relay_not_sent_again() {
    let Scene {
        app,
        broker,
        sink,
        ride_id,
        worker,
    } = scene(true).await;
    leave_crashed_claim(&app, &sink, ride_id, true, -1.0).await;
    assert_eq!(sink.received().len(), 1);

    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!((summary.recovered, summary.sent), (1, 0), "{summary:?}");
    assert_eq!(sink.received().len(), 1, "the rider got one mail");
    assert_eq!(sent_count(&app).await, 1);
    assert_eq!(recorded_via(&app, ride_id).await, "relay_search");
    assert_eq!(claims_left(&app).await, 0);
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_whose_mail_never_reached_the_relay_is_sent_once() {
    let Scene {
        app,
        broker,
        sink,
        ride_id,
        worker,
    } = scene(true).await;
    leave_crashed_claim(&app, &sink, ride_id, false, -1.0).await;

    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(
        (summary.sent, summary.recovered, summary.unverified_resends),
        (1, 0, 0),
        "{summary:?}"
    );
    let mails = sink.received();
    assert_eq!(mails.len(), 1);
    assert_eq!(mails[0].message_id(), Some(receipt_message_id(ride_id)));
    assert_eq!(recorded_via(&app, ride_id).await, "smtp");
    assert_eq!(claims_left(&app).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_relay_search_an_unrecorded_claim_is_resent_and_counted() {
    let Scene {
        app,
        broker,
        sink,
        ride_id,
        worker,
    } = scene(false).await;
    leave_crashed_claim(&app, &sink, ride_id, true, -1.0).await;

    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(
        (summary.sent, summary.unverified_resends),
        (1, 1),
        "{summary:?}"
    );
    // The documented fallback: a second copy with the same Message-ID rather than none.
    let mails = sink.received();
    assert_eq!(mails.len(), 2);
    assert!(
        mails
            .iter()
            .all(|m| m.message_id() == Some(receipt_message_id(ride_id)))
    );
    assert_eq!(sent_count(&app).await, 1);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_claim_holds_off_a_second_sender_until_its_lease_ends() {
    let Scene {
        app,
        broker,
        sink,
        ride_id,
        worker,
    } = scene(true).await;
    // Another attempt is (as far as anyone can tell) still talking to the relay for 3 s.
    leave_crashed_claim(&app, &sink, ride_id, false, 3.0).await;

    let channel = broker.session.channel.clone();
    let pass = tokio::spawn(async move { worker.run_once(&channel).await });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        sink.received().is_empty(),
        "sent while another attempt held the claim"
    );
    let summary = pass.await.unwrap().unwrap();
    assert_eq!((summary.sent, summary.retried), (1, 0), "{summary:?}");
    assert_eq!(sink.received().len(), 1);
    assert_eq!(claims_left(&app).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_relay_search_that_fails_is_a_temporary_failure_not_a_blind_resend() {
    let Scene {
        app,
        broker,
        sink,
        ride_id,
        worker,
    } = scene(true).await;
    leave_crashed_claim(&app, &sink, ride_id, true, -1.0).await;
    sink.fail_next_searches(1);

    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(
        (summary.retried, summary.recovered, summary.sent),
        (1, 1, 0),
        "{summary:?}"
    );
    assert_eq!(sink.received().len(), 1);
    assert_eq!(recorded_via(&app, ride_id).await, "relay_search");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_temporary_failure_ends_the_claim_so_the_retry_need_not_wait_for_the_lease() {
    let Scene {
        app,
        broker,
        sink,
        ride_id,
        worker,
    } = scene(true).await;
    sink.fail_next(1, 451);
    // The lease (30 s in the test config) would stall the retry if the failure kept it.
    let pass = tokio::time::timeout(
        Duration::from_secs(20),
        worker.run_once(&broker.session.channel),
    )
    .await
    .expect("the retry waited for the failed attempt's lease")
    .unwrap();
    assert_eq!((pass.retried, pass.sent), (1, 1), "{pass:?}");
    assert_eq!(sink.received().len(), 1);
    assert_eq!(recorded_via(&app, ride_id).await, "smtp");
    broker.cleanup().await;
}

/// A send the worker gave up on (its SMTP timeout) can still be kept by a slow relay after the
/// worker has gone. The attempt keeps its claim's lease, so the retry asks the relay's search only
/// once the lease has run out, finds the mail, and does not send it again. Ending the lease at
/// once, as for a refused send, let the long campaign 40d06df2 mail two rides twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_send_cut_off_by_the_timeout_keeps_the_lease_so_the_retry_finds_the_mail() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let search = sink
        .serve_search("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let ride_id = common::paid_ride(&app, &broker).await;
    let worker =
        common::receipt_worker_configured(&app.pool, &broker, &sink, Some(&search), |config| {
            config.smtp_timeout = Duration::from_millis(500);
            config.claim_lease = Duration::from_secs(3);
        });
    // The relay keeps the mail 1.5 s after the end of DATA, long after the worker gave up.
    sink.accept_slowly_next(1, Duration::from_millis(1500));

    let summary = worker.run_once(&broker.session.channel).await.unwrap();

    assert_eq!(
        (summary.retried, summary.recovered, summary.sent),
        (1, 1, 0),
        "{summary:?}"
    );
    assert_eq!(sink.received().len(), 1, "the rider got one mail");
    assert_eq!(sent_count(&app).await, 1);
    assert_eq!(recorded_via(&app, ride_id).await, "relay_search");
    assert_eq!(claims_left(&app).await, 0);
    broker.cleanup().await;
}
