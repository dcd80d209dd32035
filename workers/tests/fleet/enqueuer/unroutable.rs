//! Jobs the broker cannot route yet: they do not hold back the receipts behind them, go out once
//! a queue is bound, are parked past the attempt limit, and a malformed receipt behind them still
//! reaches the dead letter queue.

use contract::{BackgroundJob, ReceiptJob};
use diesel_async::RunQueryDsl;
use schema::{models::NewStagedJob, schema::staged_jobs, testing::TestDatabase};
use workers::enqueuer::Enqueuer;

use crate::common::{self, TestBroker};

use super::ids;

/// A job name no queue is bound for: a job type deployed before its consumer.
const UNCONSUMED: &str = "audit_export";

async fn insert_named(pool: &schema::Pool, job_name: &str, args: serde_json::Value) -> i64 {
    let mut conn = pool.get().await.unwrap();
    let empty = serde_json::json!({});
    diesel::insert_into(staged_jobs::table)
        .values(NewStagedJob {
            job_name,
            job_args: &args,
            trace_context: &empty,
        })
        .returning(staged_jobs::id)
        .get_result(&mut conn)
        .await
        .unwrap()
}

/// Stages `layout` in id order, `U` an unroutable job and `R` a receipt; returns both id lists.
async fn stage_layout(pool: &schema::Pool, layout: &str) -> (Vec<i64>, Vec<i64>) {
    let (mut unroutable, mut receipts) = (Vec::new(), Vec::new());
    for (i, kind) in layout.chars().enumerate() {
        match kind {
            'U' => {
                unroutable.push(insert_named(pool, UNCONSUMED, serde_json::json!({"n": i})).await)
            }
            'R' => receipts.push(
                insert_named(
                    pool,
                    ReceiptJob::JOB_NAME,
                    common::receipt_args(i as i64 + 1),
                )
                .await,
            ),
            other => panic!("layout {other}"),
        }
    }
    (unroutable, receipts)
}

/// Lets every set-aside job's back-off run out, as waiting would.
async fn make_due(pool: &schema::Pool) {
    let mut conn = pool.get().await.unwrap();
    diesel::sql_query(
        "UPDATE staged_jobs SET next_attempt_at = now() WHERE next_attempt_at IS NOT NULL",
    )
    .execute(&mut conn)
    .await
    .unwrap();
}

#[derive(Debug, PartialEq, diesel::QueryableByName)]
struct Held {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    id: i64,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    attempts: i32,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    backing_off: bool,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    parked: bool,
}

/// An enqueuer whose back-off (a minute) outlasts any slow step of a test on a loaded machine, so
/// "within the back-off" holds for the whole test.
fn patient_enqueuer(pool: &schema::Pool, broker: &TestBroker, batch_size: i64) -> Enqueuer {
    Enqueuer::new(
        pool.clone(),
        &common::amqp_url(),
        broker.topology.clone(),
        workers::config::EnqueuerConfig {
            backoff_base: std::time::Duration::from_secs(60),
            ..common::enqueuer_config(batch_size)
        },
    )
}

async fn held(pool: &schema::Pool) -> Vec<Held> {
    let mut conn = pool.get().await.unwrap();
    diesel::sql_query(
        "SELECT id, attempts, COALESCE(next_attempt_at > now(), false) AS backing_off, \
         parked_at IS NOT NULL AS parked FROM staged_jobs ORDER BY id",
    )
    .load(&mut conn)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn unroutable_jobs_anywhere_do_not_hold_back_the_receipts_behind_them() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let layouts = [
        ("at the head", "UUUUURRR"),
        ("in the middle", "RRUUUUURR"),
        ("interleaved", "URURUURRUR"),
    ];
    for batch_size in [1, 2, common::enqueuer_config(1000).batch_size] {
        for (name, layout) in layouts {
            let case = format!("{name}, batch size {batch_size}");
            let (unroutable, receipts) = stage_layout(&pool, layout).await;

            let summary = patient_enqueuer(&pool, &broker, batch_size)
                .run_once()
                .await
                .unwrap();
            assert_eq!(summary.published, receipts.len() as u64, "{case}");
            assert_eq!(summary.returned, unroutable.len() as u64, "{case}");
            assert_eq!(summary.set_aside, unroutable.len() as u64, "{case}");
            assert_eq!(summary.parked, 0, "{case}");
            assert_eq!(
                ids(&broker.take_all(&broker.topology.receipts_queue).await),
                receipts,
                "{case}: every receipt in the same pass"
            );
            let expected: Vec<Held> = unroutable
                .iter()
                .map(|&id| Held {
                    id,
                    attempts: 1,
                    backing_off: true,
                    parked: false,
                })
                .collect();
            assert_eq!(
                held(&pool).await,
                expected,
                "{case}: set aside, not deleted"
            );

            // Within the back-off a pass leaves them alone.
            let again = patient_enqueuer(&pool, &broker, batch_size)
                .run_once()
                .await
                .unwrap();
            assert_eq!((again.published, again.returned), (0, 0), "{case}");
            assert_eq!(common::staged_ids(&pool).await, unroutable, "{case}");

            let mut conn = pool.get().await.unwrap();
            diesel::sql_query("DELETE FROM staged_jobs")
                .execute(&mut conn)
                .await
                .unwrap();
        }
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn set_aside_jobs_go_out_once_a_queue_for_them_is_bound() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let (unroutable, receipts) = stage_layout(&pool, "UURUU").await;
    let first = common::enqueuer(&pool, &broker, 2)
        .run_once()
        .await
        .unwrap();
    assert_eq!((first.published, first.set_aside), (1, 4));
    assert_eq!(
        ids(&broker.take_all(&broker.topology.receipts_queue).await),
        receipts
    );

    // The consumer is deployed: its queue is bound to the job name.
    let queue = format!("{}.{UNCONSUMED}", broker.topology.exchange);
    let channel = &broker.session.channel;
    channel
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.as_str().into(),
            broker.topology.exchange.as_str().into(),
            UNCONSUMED.into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    make_due(&pool).await;

    let second = common::enqueuer(&pool, &broker, 2)
        .run_once()
        .await
        .unwrap();
    assert_eq!((second.published, second.returned), (4, 0));
    assert!(common::staged_ids(&pool).await.is_empty());
    assert_eq!(ids(&broker.take_all(&queue).await), unroutable);
    channel
        .queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_returned_past_the_attempt_limit_is_parked_and_listed_by_the_backlog() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let (unroutable, _) = stage_layout(&pool, "U").await;
    let mut config = common::enqueuer_config(10);
    config.max_attempts = 3;
    let mut enqueuer = Enqueuer::new(
        pool.clone(),
        &common::amqp_url(),
        broker.topology.clone(),
        config,
    );
    let mut passes = Vec::new();
    for _ in 0..4 {
        let summary = enqueuer.run_once().await.unwrap();
        passes.push((summary.returned, summary.set_aside, summary.parked));
        make_due(&pool).await;
    }
    assert_eq!(
        passes,
        [(1, 1, 0), (1, 1, 0), (1, 0, 1), (0, 0, 0)],
        "tried max_attempts times, then left alone"
    );
    assert_eq!(
        held(&pool).await,
        [Held {
            id: unroutable[0],
            attempts: 3,
            backing_off: false,
            parked: true,
        }],
        "parked, never deleted"
    );

    let report = workers::admin::backlog::backlog(&pool, &common::amqp_url(), &broker.topology)
        .await
        .unwrap();
    assert_eq!(report.held_jobs.len(), 1);
    let parked = &report.held_jobs[0];
    assert_eq!(
        (
            parked.job_name.as_str(),
            parked.state.as_str(),
            parked.count
        ),
        (UNCONSUMED, "parked", 1)
    );
    assert_eq!((parked.oldest_id, parked.max_attempts), (unroutable[0], 3));
    assert!(
        parked.last_error.as_deref().unwrap().contains("NO_ROUTE"),
        "{:?}",
        parked.last_error
    );
    let text = report.render();
    assert!(text.contains("parked"), "{text}");
    assert!(text.contains(UNCONSUMED), "{text}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_receipt_behind_unroutable_jobs_still_reaches_the_dead_letter_queue() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    stage_layout(&pool, "UUU").await;
    let malformed = insert_named(
        &pool,
        ReceiptJob::JOB_NAME,
        serde_json::json!({"ride_id": "not a number"}),
    )
    .await;

    let summary = common::enqueuer(&pool, &broker, 2)
        .run_once()
        .await
        .unwrap();
    assert_eq!((summary.published, summary.set_aside), (1, 3));
    let sink = common::mail_sink().await;
    let worker = common::receipt_worker(&pool, &broker, &sink);
    let consumed = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!((consumed.dead_lettered, consumed.sent), (1, 0));
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.dead_letter_queue, 1)
            .await,
        1
    );
    assert_eq!(
        ids(&broker.take_all(&broker.topology.dead_letter_queue).await),
        [malformed]
    );
    broker.cleanup().await;
}
