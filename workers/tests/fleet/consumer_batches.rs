//! How the generic consumer forms its batches on a real queue: a delivery to an idle consumer goes
//! to the handler at once, however long `batch_wait` is; while a batch is in flight the next one
//! fills (and goes as soon as it is full), and what is left goes when the consumer is idle again
//! or when its `batch_wait` is over, whichever comes first.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use chrono::{TimeZone, Utc};
use contract::{
    ReceiptJob,
    message::{RECEIPT_MESSAGE_TYPE, RECEIPT_MESSAGE_VERSION, ReceiptMessage},
};
use tokio::sync::Semaphore;
use workers::{
    CancellationToken,
    consumer::{ConsumerSettings, Delivered, JobConsumer, JobCounts, JobHandler, JobOutcome},
};

use crate::common::{self, TestBroker};

/// Records the rides of every batch it is handed; the first batch is held until `release`.
struct HoldingHandler {
    batches: Mutex<Vec<Vec<i64>>>,
    release: Semaphore,
}

impl JobHandler for HoldingHandler {
    type Job = ReceiptJob;
    type Outcome = JobOutcome;
    type Summary = JobCounts;

    async fn run(&self, _: Delivered<ReceiptJob>, _: &CancellationToken) -> JobOutcome {
        unreachable!("run_batch is overridden")
    }

    async fn run_batch(
        &self,
        jobs: Vec<Delivered<ReceiptJob>>,
        _: &CancellationToken,
    ) -> Vec<JobOutcome> {
        let first = {
            let mut batches = self.batches.lock().unwrap();
            batches.push(jobs.iter().map(|delivered| delivered.job.ride_id).collect());
            batches.len() == 1
        };
        if first {
            drop(self.release.acquire().await.unwrap());
        }
        jobs.iter().map(|_| JobOutcome::Done).collect()
    }
}

impl HoldingHandler {
    fn batches(&self) -> Vec<Vec<i64>> {
        self.batches.lock().unwrap().clone()
    }

    /// Waits until `count` batches were handed over; the batches so far.
    async fn wait_for_batches(&self, count: usize) -> Vec<Vec<i64>> {
        let deadline = tokio::time::Instant::now() + common::DEADLINE;
        while self.batches().len() < count && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.batches()
    }
}

async fn publish(broker: &TestBroker, ride_id: i64) {
    let message = ReceiptMessage {
        version: RECEIPT_MESSAGE_VERSION,
        kind: RECEIPT_MESSAGE_TYPE.to_owned(),
        ride_id,
        user_id: 1,
        charge_id: format!("pi_{ride_id}"),
        amount: 2000,
        currency: "usd".into(),
        created_at: Utc.with_ymd_and_hms(2026, 11, 28, 9, 0, 0).unwrap(),
    };
    broker
        .publish_raw(&format!("job-{ride_id}"), &message.encode().unwrap())
        .await;
}

struct Running {
    broker: TestBroker,
    handler: Arc<HoldingHandler>,
    shutdown: CancellationToken,
    running: tokio::task::JoinHandle<JobCounts>,
}

/// A consumer of batches of up to four on a queue of its own, its handler holding the first.
async fn start(batch_wait: Duration) -> Running {
    let broker = TestBroker::new().await;
    let handler = Arc::new(HoldingHandler {
        batches: Mutex::new(Vec::new()),
        release: Semaphore::new(0),
    });
    let settings = ConsumerSettings {
        prefetch: 16,
        batch_size: 4,
        batch_wait,
        retry_base_delay: Duration::from_millis(20),
        retry_max_delay: Duration::from_millis(100),
    };
    let consumer = Arc::new(JobConsumer::new(
        Arc::clone(&handler),
        broker.topology.clone(),
        settings,
    ));
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (url, shutdown) = (broker.url.clone(), shutdown.clone());
        async move { consumer.run(&url, shutdown).await }
    });
    Running {
        broker,
        handler,
        shutdown,
        running,
    }
}

impl Running {
    /// Stops the consumer; every delivery was handed over once and acknowledged.
    async fn stop(self, received: u64) {
        self.handler.release.add_permits(1);
        self.shutdown.cancel();
        let summary = self.running.await.unwrap();
        assert_eq!((summary.received, summary.done), (received, received));
        let broker = self.broker;
        assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
        broker.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn batches_go_at_once_when_idle_fill_while_another_runs_and_never_wait_out_an_idle_consumer()
{
    // Far longer than the test: a batch that went out did not wait it out.
    let run = start(Duration::from_secs(600)).await;
    let (broker, handler) = (&run.broker, &run.handler);

    // Idle: the one delivery goes at once, alone.
    publish(broker, 1).await;
    assert_eq!(handler.wait_for_batches(1).await, vec![vec![1]]);

    // While it is held, five more: four fill a batch, which goes as soon as it is full.
    for ride_id in 2..=6 {
        publish(broker, ride_id).await;
    }
    let batches = handler.wait_for_batches(2).await;
    assert_eq!(batches, vec![vec![1], vec![2, 3, 4, 5]]);
    // The sixth waits: the first batch is still in flight and its own wait has not run out.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(handler.batches().len(), 2, "{:?}", handler.batches());

    // Once nothing is in flight it goes, long before its wait would have ended.
    handler.release.add_permits(1);
    let batches = handler.wait_for_batches(3).await;
    assert_eq!(batches, vec![vec![1], vec![2, 3, 4, 5], vec![6]]);
    run.stop(6).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_that_does_not_fill_goes_when_its_wait_is_over_while_another_is_in_flight() {
    let run = start(Duration::from_millis(50)).await;
    let (broker, handler) = (&run.broker, &run.handler);
    publish(broker, 1).await;
    assert_eq!(handler.wait_for_batches(1).await, vec![vec![1]]);

    // The first batch is held until `stop`: the consumer is never idle and no batch of these
    // fills, so only a wait running out hands them over (together, or apart if the second
    // arrived after the first's wait was over).
    publish(broker, 2).await;
    publish(broker, 3).await;
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    while handler.batches().concat().len() < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let batches = handler.batches();
    assert_eq!(batches[0], vec![1]);
    assert_eq!(batches[1..].concat(), vec![2, 3], "{batches:?}");
    run.stop(3).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_shutdown_the_forming_batch_is_run_and_settled_not_left_unacked() {
    // Far longer than the test: only the shutdown can hand the second batch over.
    let run = start(Duration::from_secs(600)).await;
    let (broker, handler) = (&run.broker, &run.handler);
    publish(broker, 1).await;
    assert_eq!(handler.wait_for_batches(1).await, vec![vec![1]]);
    publish(broker, 2).await;
    // The second delivery is taken and forming behind the held first batch.
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    while broker.depth(&broker.topology.receipts_queue).await > 0
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(handler.batches(), vec![vec![1]]);

    // Shutdown first, then the first batch lets go: the forming one was handed over on the way.
    run.shutdown.cancel();
    handler.release.add_permits(1);
    let summary = run.running.await.unwrap();
    assert_eq!(handler.batches(), vec![vec![1], vec![2]]);
    assert_eq!((summary.received, summary.done), (2, 2));
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
    run.broker.cleanup().await;
}
