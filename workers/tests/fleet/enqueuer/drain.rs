//! The drain: a job published with the message contract and deleted, batches drained exactly once,
//! rolled-back jobs never published, a lost connection or a dead node losing nothing, two
//! enqueuers sharing the work, and shutdown.

use std::collections::BTreeSet;

use contract::{BackgroundJob, ReceiptJob, message::ReceiptMessage};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use lapin::types::AMQPValue;
use schema::{models::NewStagedJob, schema::staged_jobs, testing::TestDatabase};
use workers::{amqp::AmqpSession, enqueuer::Enqueuer};

use crate::common::{self, TestBroker};

use super::ids;

#[tokio::test(flavor = "multi_thread")]
async fn publishes_a_job_with_the_message_contract_and_deletes_it() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let mut conn = pool.get().await.unwrap();
    let args = common::receipt_args(7);
    let trace = serde_json::json!({
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "tracestate": "rides=1",
    });
    let id: i64 = diesel::insert_into(staged_jobs::table)
        .values(NewStagedJob {
            job_name: ReceiptJob::JOB_NAME,
            job_args: &args,
            trace_context: &trace,
        })
        .returning(staged_jobs::id)
        .get_result(&mut conn)
        .await
        .unwrap();

    let summary = common::enqueuer(&pool, &broker, 1000)
        .run_once()
        .await
        .unwrap();
    assert_eq!(summary.published, 1);
    assert!(common::staged_ids(&pool).await.is_empty());

    let taken = broker.take_all(&broker.topology.receipts_queue).await;
    assert_eq!(taken.len(), 1);
    let message = &taken[0];
    assert_eq!(message.message_id, id.to_string());
    assert_eq!(message.properties.delivery_mode(), &Some(2));
    assert_eq!(
        message
            .properties
            .content_type()
            .as_ref()
            .map(|c| c.to_string()),
        Some("application/json".to_owned())
    );
    let headers = message
        .properties
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .clone();
    let header = |name: &str| match headers.get(name) {
        Some(AMQPValue::LongString(value)) => value.to_string(),
        other => panic!("header {name}: {other:?}"),
    };
    assert_eq!(
        header("traceparent"),
        trace["traceparent"].as_str().unwrap()
    );
    assert_eq!(header("tracestate"), "rides=1");
    let receipt = ReceiptMessage::decode(&message.body).unwrap();
    assert_eq!(receipt.version, 1);
    assert_eq!(receipt.kind, "ride.receipt");
    assert_eq!(receipt.ride_id, 7);
    assert_eq!(receipt.charge_id, "pi_7");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn drains_more_than_one_batch_exactly_once() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let staged = common::stage_jobs(&pool, 250).await;

    let summary = common::enqueuer(&pool, &broker, 100)
        .run_once()
        .await
        .unwrap();
    assert_eq!(summary.published, 250);
    assert_eq!(summary.batches, 3);
    assert!(common::staged_ids(&pool).await.is_empty());
    let published = ids(&broker.take_all(&broker.topology.receipts_queue).await);
    assert_eq!(published, staged, "every job once, in id order");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn empty_table_publishes_nothing() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let summary = common::enqueuer(&pool, &broker, 10)
        .run_once()
        .await
        .unwrap();
    assert_eq!(summary.published, 0);
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rolled_back_jobs_are_never_published_and_late_commits_are_not_lost() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    // A transaction that rolls back: its job must never reach the broker.
    let mut rolled_back = db.connect().await;
    diesel::sql_query("BEGIN")
        .execute(&mut rolled_back)
        .await
        .unwrap();
    let rolled_back_id = insert_job(&mut rolled_back).await.unwrap();
    diesel::sql_query("ROLLBACK")
        .execute(&mut rolled_back)
        .await
        .unwrap();

    // A transaction that takes the lowest id but commits only after a drain has run: the
    // reference's `DELETE … WHERE id <= max(id)` would delete it unsent.
    let mut slow = db.connect().await;
    diesel::sql_query("BEGIN").execute(&mut slow).await.unwrap();
    let slow_id = insert_job(&mut slow).await.unwrap();
    let fast = common::stage_jobs(&pool, 5).await;
    assert!(fast.iter().all(|id| *id > slow_id));

    let mut enqueuer = common::enqueuer(&pool, &broker, 1000);
    assert_eq!(enqueuer.run_once().await.unwrap().published, 5);
    diesel::sql_query("COMMIT")
        .execute(&mut slow)
        .await
        .unwrap();
    assert_eq!(common::staged_ids(&pool).await, vec![slow_id]);
    assert_eq!(enqueuer.run_once().await.unwrap().published, 1);

    let published: BTreeSet<i64> = ids(&broker.take_all(&broker.topology.receipts_queue).await)
        .into_iter()
        .collect();
    let mut expected: BTreeSet<i64> = fast.into_iter().collect();
    expected.insert(slow_id);
    assert_eq!(published, expected);
    assert!(!published.contains(&rolled_back_id));
    assert!(common::staged_ids(&pool).await.is_empty());
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_returned_unroutable_job_stays_staged() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let mut conn = pool.get().await.unwrap();
    let args = serde_json::json!({"anything": true});
    let empty = serde_json::json!({});
    let unroutable: i64 = diesel::insert_into(staged_jobs::table)
        .values(NewStagedJob {
            job_name: "nobody_consumes_this",
            job_args: &args,
            trace_context: &empty,
        })
        .returning(staged_jobs::id)
        .get_result(&mut conn)
        .await
        .unwrap();
    let routable = common::stage_jobs(&pool, 2).await;

    let summary = common::enqueuer(&pool, &broker, 1000)
        .run_once()
        .await
        .unwrap();
    assert_eq!(summary.published, 2);
    assert_eq!(summary.returned, 1);
    assert_eq!(common::staged_ids(&pool).await, vec![unroutable]);
    assert_eq!(
        ids(&broker.take_all(&broker.topology.receipts_queue).await),
        routable
    );
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn connection_lost_during_a_drain_loses_nothing() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let staged = common::stage_jobs(&pool, 3000).await;
    let proxy = common::Proxy::spawn(common::broker_addr()).await;
    let mut enqueuer = Enqueuer::new(
        pool.clone(),
        &proxy.amqp_url(),
        broker.topology.clone(),
        common::enqueuer_config(1000),
    );
    // Enough for the handshake, the topology and part of the first batches, not all 3000.
    proxy.sever_after(400_000);

    let interrupted = enqueuer.run_once().await;
    assert!(
        interrupted.is_err(),
        "the severed connection must surface: {interrupted:?}"
    );
    assert!(proxy.is_severed());
    let left = common::staged_ids(&pool).await;
    assert!(
        !left.is_empty() && left.len() < staged.len(),
        "cut mid-drain: {} left",
        left.len()
    );
    // Whatever was deleted reached the queue: nothing is lost.
    let first: BTreeSet<i64> = ids(&broker.take_all(&broker.topology.receipts_queue).await)
        .into_iter()
        .collect();
    for id in &staged {
        assert!(first.contains(id) || left.contains(id), "job {id} lost");
    }

    // Broker still down: the pass fails again, nothing is deleted.
    assert!(enqueuer.run_once().await.is_err());
    assert_eq!(common::staged_ids(&pool).await, left);

    proxy.restore();
    let resumed = enqueuer.run_once().await.unwrap();
    assert!(common::staged_ids(&pool).await.is_empty());
    let second: BTreeSet<i64> = ids(&broker.take_all(&broker.topology.receipts_queue).await)
        .into_iter()
        .collect();
    assert_eq!(resumed.published as usize, left.len());
    let all: BTreeSet<i64> = first.union(&second).copied().collect();
    assert_eq!(all, staged.iter().copied().collect::<BTreeSet<_>>());
    broker.cleanup().await;
}

/// A node that refuses connections is passed over, whichever position it has in the list.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_opens_on_any_live_node_of_the_list() {
    let broker = TestBroker::new().await;
    let topology = &broker.topology;
    let dead = common::Proxy::spawn(common::broker_addr()).await;
    dead.sever_after(0);
    for cluster in [
        format!("{},{}", dead.amqp_url(), common::amqp_url()),
        format!("{},{}", common::amqp_url(), dead.amqp_url()),
        format!("{0},{0},{1}", dead.amqp_url(), common::amqp_url()),
    ] {
        for _ in 0..3 {
            let session = AmqpSession::open(&cluster, topology).await.unwrap();
            assert!(session.is_usable());
            session.close().await;
        }
    }
    let only_dead = AmqpSession::open(&dead.amqp_url(), topology).await;
    assert!(only_dead.is_err(), "a list of dead nodes must fail");
    broker.cleanup().await;
}

/// `AMQP_URL` lists a cluster's nodes (two proxies to one broker stand in for two nodes): when
/// the node in use dies mid-drain, the next pass connects to the other and nothing is lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_node_is_passed_over_for_a_live_one() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let staged = common::stage_jobs(&pool, 3000).await;
    let first_node = common::Proxy::spawn(common::broker_addr()).await;
    let second_node = common::Proxy::spawn(common::broker_addr()).await;
    let cluster = format!("{},{}", first_node.amqp_url(), second_node.amqp_url());
    let mut enqueuer = Enqueuer::new(
        pool.clone(),
        &cluster,
        broker.topology.clone(),
        common::enqueuer_config(1000),
    );
    // Whichever node the first pass uses dies part-way through the drain and stays dead.
    first_node.sever_after(400_000);
    second_node.sever_after(400_000);
    assert!(enqueuer.run_once().await.is_err());
    let (dead, live) = if first_node.is_severed() {
        (&first_node, &second_node)
    } else {
        (&second_node, &first_node)
    };
    assert!(dead.is_severed() && !live.is_severed());
    live.restore();

    let resumed = enqueuer.run_once().await.unwrap();
    assert!(common::staged_ids(&pool).await.is_empty());
    assert!(dead.is_severed(), "the dead node stays dead");
    let delivered: BTreeSet<i64> = ids(&broker.take_all(&broker.topology.receipts_queue).await)
        .into_iter()
        .collect();
    assert_eq!(delivered, staged.iter().copied().collect::<BTreeSet<_>>());
    assert!(resumed.published > 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_enqueuers_share_the_work_without_losing_or_doubling() {
    let db = TestDatabase::new().await;
    let pool = db.pool(8);
    let broker = TestBroker::new().await;
    let staged = common::stage_jobs(&pool, 3000).await;
    let mut first = common::enqueuer(&pool, &broker, 200);
    let mut second = common::enqueuer(&pool, &broker, 200);

    let (a, b) = tokio::join!(first.run_once(), second.run_once());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.published + b.published, 3000);
    // Normally both get a share; the invariant that matters is the total below.
    assert!(common::staged_ids(&pool).await.is_empty());
    let published = ids(&broker.take_all(&broker.topology.receipts_queue).await);
    assert_eq!(published.len(), 3000, "no job published twice");
    let distinct: BTreeSet<i64> = published.into_iter().collect();
    assert_eq!(distinct, staged.into_iter().collect::<BTreeSet<_>>());
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_loop_drains_and_stops_on_shutdown() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let shutdown = workers::CancellationToken::new();
    let enqueuer = common::enqueuer(&pool, &broker, 100);
    let running = tokio::spawn(enqueuer.run(shutdown.clone()));
    let staged = common::stage_jobs(&pool, 150).await;
    assert_eq!(
        broker
            .wait_for_depth(&broker.topology.receipts_queue, 150)
            .await,
        150
    );
    shutdown.cancel();
    let total = running.await.unwrap();
    assert_eq!(total.published, 150);
    assert_eq!(
        ids(&broker.take_all(&broker.topology.receipts_queue).await),
        staged
    );
    broker.cleanup().await;
}

async fn insert_job(conn: &mut AsyncPgConnection) -> Result<i64, diesel::result::Error> {
    let args = common::receipt_args(1);
    let empty = serde_json::json!({});
    diesel::insert_into(staged_jobs::table)
        .values(NewStagedJob {
            job_name: ReceiptJob::JOB_NAME,
            job_args: &args,
            trace_context: &empty,
        })
        .returning(staged_jobs::id)
        .get_result::<i64>(conn)
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_finishes_the_batch_in_flight_and_leaves_the_backlog_staged() {
    let db = TestDatabase::new().await;
    let pool = db.pool(4);
    let broker = TestBroker::new().await;
    let staged = common::stage_jobs(&pool, 20_000).await;
    let shutdown = workers::CancellationToken::new();
    let running = tokio::spawn(common::enqueuer(&pool, &broker, 10).run(shutdown.clone()));
    while common::staged_ids(&pool).await.len() == staged.len() {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    shutdown.cancel();
    let total = running.await.unwrap();

    let left = common::staged_ids(&pool).await;
    assert!(!left.is_empty(), "stopped without draining the backlog");
    assert_eq!(total.published % 10, 0, "only whole batches: {total:?}");
    let published = ids(&broker.take_all(&broker.topology.receipts_queue).await);
    assert_eq!(published.len() as u64, total.published);
    // Oldest first: what went out is exactly the head of the table, what stayed is the rest.
    assert_eq!(published, staged[..published.len()]);
    assert_eq!(left, staged[published.len()..]);
    broker.cleanup().await;
}
