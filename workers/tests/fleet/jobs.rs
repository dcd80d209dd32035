//! The generic consumer runs any registered job type: a test-only job type, registered in one
//! place (`registry` below), is staged in PostgreSQL, routed by the enqueuer into a queue of its
//! own, and run, retried and dead-lettered by the same loop as the receipts.

use std::{
    collections::BTreeSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use api_server::testing::TestApp;
use contract::BackgroundJob;
use serde::{Deserialize, Serialize};
use workers::{
    CancellationToken,
    consumer::{ConsumerSettings, Delivered, JobConsumer, JobCounts, JobHandler, JobOutcome},
    jobs::{JobType, Registry},
};

use crate::common::{self, TestBroker};

/// The test's job type: its contract side.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Ping {
    n: i64,
}

impl BackgroundJob for Ping {
    const JOB_NAME: &'static str = "test_ping";
}

/// Its registration: the fleet's job types and this one.
fn registry() -> Registry {
    workers::jobs::registry().register::<Ping>()
}

/// Its handler: a negative number is poison, 13 fails once.
#[derive(Default)]
struct PingHandler {
    done: Mutex<Vec<i64>>,
    failed_once: AtomicBool,
}

impl JobHandler for PingHandler {
    type Job = Ping;
    type Outcome = JobOutcome;
    type Summary = JobCounts;

    async fn run(&self, delivered: Delivered<Ping>, _: &CancellationToken) -> JobOutcome {
        match delivered.job.n {
            n if n < 0 => JobOutcome::DeadLetter(format!("{n} is negative")),
            13 if !self.failed_once.swap(true, Ordering::SeqCst) => {
                JobOutcome::Retry("unlucky".into())
            }
            n => {
                self.done.lock().unwrap().push(n);
                JobOutcome::Done
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_job_type_is_routed_run_retried_and_dead_lettered_by_the_generic_consumer() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::declaring(&common::amqp_url(), 5, registry()).await;
    {
        let mut conn = app.pool.get().await.unwrap();
        for n in (1..=20).chain([-1]) {
            stage(&mut conn, Ping { n }.staged()).await;
        }
        // Args that are not a Ping: published as they are, dead-lettered by the consumer.
        let mut foreign = Ping { n: 0 }.staged();
        foreign.job_args = serde_json::json!({"not": "a ping"}).into();
        stage(&mut conn, foreign).await;
    }
    let enqueued = common::enqueuer(&app.pool, &broker, 100)
        .run_once()
        .await
        .unwrap();
    assert_eq!(enqueued.published, 22);
    let queue = broker.topology.queue_of(&JobType::of::<Ping>());
    assert!(queue.ends_with(".test_ping"), "{queue}");
    assert_eq!(broker.wait_for_depth(&queue, 22).await, 22);
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);

    let handler = Arc::new(PingHandler::default());
    let settings = ConsumerSettings {
        prefetch: 8,
        batch_size: 4,
        batch_wait: Duration::from_millis(5),
        retry_base_delay: Duration::from_millis(20),
        retry_max_delay: Duration::from_millis(100),
    };
    let consumer = Arc::new(JobConsumer::new(
        Arc::clone(&handler),
        broker.topology.clone(),
        settings,
    ));
    assert_eq!(consumer.queue(), queue);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (url, shutdown) = (broker.url.clone(), shutdown.clone());
        async move { consumer.run(&url, shutdown).await }
    });
    let dead = broker
        .wait_for_depth(&broker.topology.dead_letter_queue, 2)
        .await;
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    while handler.done.lock().unwrap().len() < 20 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let summary = running.await.unwrap();

    let done: BTreeSet<i64> = handler.done.lock().unwrap().iter().copied().collect();
    assert_eq!(done, (1..=20).collect());
    assert_eq!(handler.done.lock().unwrap().len(), 20, "each ran once");
    assert_eq!(dead, 2);
    assert_eq!(
        summary,
        JobCounts {
            received: 23,
            done: 20,
            dead_lettered: 2,
            retried: 1,
        }
    );
    assert_eq!(broker.depth(&queue).await, 0);
    broker.cleanup().await;
}

/// Stages `job` as a business transaction would (in production only the charge's record,
/// `contract::writes::RecordCharge`, stages a job; a test-only type has no such write).
async fn stage(conn: &mut diesel_async::AsyncPgConnection, job: contract::JobToStage) {
    use diesel::ExpressionMethods;
    use diesel_async::RunQueryDsl;
    use schema::schema::staged_jobs;
    diesel::insert_into(staged_jobs::table)
        .values((
            staged_jobs::job_name.eq(job.job_name),
            staged_jobs::job_args.eq(&job.job_args),
            staged_jobs::trace_context.eq(&job.trace_context),
        ))
        .execute(conn)
        .await
        .unwrap();
}
