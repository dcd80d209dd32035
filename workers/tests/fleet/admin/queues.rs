//! What waits: the attention list (oldest first, resolved one at a time), the dead letters (listed
//! in place, requeued to the receipts queue) and the backlog's counts.

use api_server::testing::{GOOD_CARD, TestApp};
use contract::{BackgroundJob, ReceiptJob};
use diesel_async::RunQueryDsl;
use schema::{RecoveryPoint, models::NewStagedJob, schema::staged_jobs};
use workers::{
    admin::{AdminError, Mode, attention, backlog, dead_letters},
    topology::Topology,
};

use crate::common::{self, TestBroker};

use super::{abandoned_at, assert_refused, attention_rows, record_attention, sql};

#[tokio::test(flavor = "multi_thread")]
async fn needing_attention_lists_oldest_first_and_resolves_one() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key_a, a) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let (key_b, b) = abandoned_at(&app, &user, RecoveryPoint::Started).await;
    let newer = record_attention(&app, &user, &key_a, a).await;
    let older = record_attention(&app, &user, &key_b, b).await;
    let resolved = record_attention(&app, &user, &key_b, b).await;
    sql(
        &app,
        &format!(
            "UPDATE keys_needing_attention SET recorded_at = now() - interval '2 hours' \
             WHERE id = {older}"
        ),
    )
    .await;
    sql(
        &app,
        &format!("UPDATE keys_needing_attention SET resolved_at = now() WHERE id = {resolved}"),
    )
    .await;

    let open = attention::list(&app.pool, false, 100).await.unwrap();
    let ids: Vec<i64> = open.rows.iter().map(|row| row.id).collect();
    assert_eq!(ids, [older, newer], "unresolved only, oldest first");
    assert_eq!(open.total, 2);
    assert_eq!(
        open.rows[0].idempotency_key, key_b,
        "keys are shown in full"
    );
    let everything = attention::list(&app.pool, true, 100).await.unwrap();
    assert_eq!(everything.total, 3);
    let limited = attention::list(&app.pool, true, 1).await.unwrap();
    assert_eq!((limited.total, limited.rows.len()), (3, 1));

    let dry = attention::resolve(&app.pool, older, Some("refunded by hand"), Mode::DryRun)
        .await
        .unwrap();
    assert_eq!(dry.changes.len(), 1);
    assert!(dry.warnings[0].contains("still exists unfinished"));
    assert!(
        dry.notes
            .iter()
            .any(|note| note.contains("refunded by hand"))
    );
    assert_eq!(
        attention::list(&app.pool, false, 100).await.unwrap().total,
        2
    );

    attention::resolve(&app.pool, older, Some("refunded by hand"), Mode::Apply)
        .await
        .unwrap();
    let open = attention::list(&app.pool, false, 100).await.unwrap();
    assert_eq!(
        open.rows.iter().map(|row| row.id).collect::<Vec<_>>(),
        [newer]
    );
    let row = attention_rows(&app)
        .await
        .into_iter()
        .find(|row| row.id == older)
        .unwrap();
    assert!(row.resolved_at.is_some());
    assert_refused(
        attention::resolve(&app.pool, older, None, Mode::Apply).await,
        "already resolved",
    );
    assert!(matches!(
        attention::resolve(&app.pool, 987_654, None, Mode::Apply).await,
        Err(AdminError::NotFound(_))
    ));
}

/// Stages receipt jobs for rides 1..=count, publishes them, and lets the receipt worker
/// dead-letter them (unknown ride, so call it before any ride exists): `count` real dead letters,
/// with `x-death`. Returns the job ids (= message ids).
async fn dead_letter(app: &TestApp, broker: &TestBroker, count: usize) -> Vec<String> {
    let ids = common::stage_jobs(&app.pool, count).await;
    let summary = common::enqueuer(&app.pool, broker, 100)
        .run_once()
        .await
        .unwrap();
    assert_eq!(summary.published, count as u64);
    let sink = common::mail_sink().await;
    let worker = common::receipt_worker(&app.pool, broker, &sink);
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!(summary.dead_lettered, count as u64);
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, count as u32)
            .await,
        count as u32
    );
    ids.into_iter().map(|id| id.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_list_leaves_them_in_place() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let ids = dead_letter(&app, &broker, 3).await;
    let url = common::amqp_url();

    let first = dead_letters::list(&url, &broker.topology, 20)
        .await
        .unwrap();
    assert_eq!(first.queue.messages, 3);
    assert_eq!(first.shown, 3);
    let mut listed: Vec<String> = first
        .messages
        .iter()
        .map(|message| message.message_id.clone().unwrap())
        .collect();
    listed.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(listed, expected);
    for message in &first.messages {
        let death = message.death.as_ref().unwrap();
        assert_eq!(death.reason.as_deref(), Some("rejected"));
        assert_eq!(death.count, Some(1));
        assert_eq!(
            death.queue.as_deref(),
            Some(broker.topology.receipts_queue.as_str())
        );
        assert_eq!(message.job_name.as_deref(), Some(ReceiptJob::JOB_NAME));
        assert!(
            message.summary.starts_with("receipt v1: ride "),
            "{}",
            message.summary
        );
    }

    // Still there, every one of them, and listing again shows the same.
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 3)
            .await,
        3
    );
    let again = dead_letters::list(&url, &broker.topology, 2).await.unwrap();
    assert_eq!((again.queue.messages, again.shown), (3, 2));
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 3)
            .await,
        3
    );
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
    let text = first.render();
    assert!(text.contains("rejected x1"), "{text}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_requeue_moves_them_back_to_the_receipts_queue() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let ids = dead_letter(&app, &broker, 3).await;
    let url = common::amqp_url();

    let dry = dead_letters::requeue(&url, &broker.topology, None, Mode::DryRun)
        .await
        .unwrap();
    assert_eq!((dry.moved, dry.dead_letter_depth_before), (3, 3));
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 3)
            .await,
        3,
        "a dry run moves nothing"
    );
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);

    let one = dead_letters::requeue(&url, &broker.topology, Some(1), Mode::Apply)
        .await
        .unwrap();
    assert_eq!(one.moved, 1);
    assert!(one.stopped.is_none());
    let rest = dead_letters::requeue(&url, &broker.topology, None, Mode::Apply)
        .await
        .unwrap();
    assert_eq!(rest.moved, 2);
    assert_eq!(rest.dead_letter_depth_after, 0);
    assert_eq!(broker.depth(&broker.topology.dead_letter_queue).await, 0);
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.receipts_queue, 3)
            .await,
        3
    );

    let taken = broker.take_all(&broker.topology.receipts_queue).await;
    let mut moved: Vec<String> = taken.iter().map(|m| m.message_id.clone()).collect();
    moved.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(moved, expected, "the same messages, by message_id");
    for message in &taken {
        let headers = message.properties.headers().as_ref().unwrap();
        assert!(
            !headers.contains_key("x-death"),
            "dead-letter history dropped"
        );
        assert!(!headers.contains_key("x-first-death-reason"));
        assert!(
            headers.contains_key("x-job-name"),
            "application headers kept"
        );
        assert_eq!(*message.properties.delivery_mode(), Some(2));
        assert_eq!(
            message.properties.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        let receipt = contract::message::ReceiptMessage::decode(&message.body).unwrap();
        assert!((1..=3).contains(&receipt.ride_id));
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn backlog_counts_staged_jobs_queues_and_open_attention() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let user = app.create_user(GOOD_CARD).await;
    common::stage_jobs(&app.pool, 3).await;
    {
        let mut conn = app.pool.get().await.unwrap();
        let args = serde_json::json!({});
        diesel::insert_into(staged_jobs::table)
            .values(NewStagedJob {
                job_name: "audit_export",
                job_args: &args,
                trace_context: &args,
            })
            .execute(&mut conn)
            .await
            .unwrap();
    }
    sql(
        &app,
        "UPDATE staged_jobs SET created_at = now() - interval '1 hour' \
         WHERE job_name = 'audit_export'",
    )
    .await;
    let (key, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    record_attention(&app, &user, &key, key_id).await;
    broker.publish_raw("m-1", b"{}").await;
    broker.publish_raw("m-2", b"{}").await;

    let report = backlog::backlog(&app.pool, &common::amqp_url(), &broker.topology)
        .await
        .unwrap();
    let staged: Vec<(&str, i64)> = report
        .staged_jobs
        .iter()
        .map(|s| (s.job_name.as_str(), s.count))
        .collect();
    assert_eq!(staged, [("audit_export", 1), (ReceiptJob::JOB_NAME, 3)]);
    let age = report.now - report.staged_jobs[0].oldest_created_at;
    assert!(age >= chrono::Duration::minutes(59), "{age:?}");
    assert_eq!(report.keys_needing_attention, 1);
    let depths: Vec<(&str, u32)> = report
        .queues
        .iter()
        .map(|q| (q.queue.as_str(), q.messages))
        .collect();
    assert_eq!(
        depths,
        [
            (broker.topology.receipts_queue.as_str(), 2),
            (broker.topology.dead_letter_queue.as_str(), 0)
        ]
    );
    assert!(report.queues_error.is_none());

    // Wrong prefix (or broker trouble): the database half is still reported.
    let wrong = Topology::from_prefix("admin-tests-missing", 5);
    let report = backlog::backlog(&app.pool, &common::amqp_url(), &wrong)
        .await
        .unwrap();
    assert_eq!(report.staged_jobs.len(), 2);
    assert!(report.queues.is_empty());
    assert!(
        report
            .queues_error
            .unwrap()
            .contains("admin-tests-missing.receipts")
    );
    broker.cleanup().await;
}
