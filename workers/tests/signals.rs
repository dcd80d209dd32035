//! The real `workers` binaries. SIGTERM: the enqueuer finishes its batch, not its backlog, and
//! loses no job; the receipt worker stops consuming, finishes what is in flight, and loses no
//! receipt. `/metrics`: the receipt worker's outcome counter counts every mail of a drained queue
//! while it keeps running (not only when another delivery arrives, or at shutdown).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "fleet/common.rs"]
#[allow(dead_code)]
mod common;

use std::{
    collections::HashSet,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use api_server::testing::{GOOD_CARD, TestApp, new_key, ride_request};
use common::TestBroker;
use diesel::QueryDsl;
use diesel_async::RunQueryDsl;

fn spawn_worker(
    subcommand: &str,
    database_url: &str,
    broker: &TestBroker,
    extra: &[(&str, &str)],
) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_workers"));
    command
        .arg(subcommand)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", common::amqp_url())
        .env("AMQP_TOPOLOGY_PREFIX", &broker.topology.exchange)
        .env("RECEIPTS_DELIVERY_LIMIT", "5")
        .env("METRICS_LISTEN_ADDR", "off")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (name, value) in extra {
        command.env(name, value);
    }
    command.spawn().unwrap()
}

async fn terminate(mut child: Child) -> String {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "no exit within 30 s of SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut logs = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut logs).unwrap();
    assert!(
        status.success(),
        "clean exit on SIGTERM: {status:?}\n{logs}"
    );
    logs
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_enqueuer_between_batches_without_losing_a_job() {
    let db = schema::testing::TestDatabase::new().await;
    let pool = db.pool(2);
    let broker = TestBroker::new().await;
    // A backlog of 200 batches: SIGTERM must end the batch in flight, not drain all of them.
    let all: HashSet<i64> = common::stage_jobs(&pool, 20_000)
        .await
        .into_iter()
        .collect();
    let child = spawn_worker(
        "enqueuer",
        db.url(),
        &broker,
        &[("ENQUEUER_BATCH_SIZE", "100")],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::staged_ids(&pool).await.len() == all.len() {
        assert!(Instant::now() < deadline, "the enqueuer made no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    terminate(child).await;

    let staged: HashSet<i64> = common::staged_ids(&pool).await.into_iter().collect();
    assert!(
        !staged.is_empty(),
        "the enqueuer drained the whole backlog after SIGTERM"
    );
    let queued: Vec<i64> = broker
        .take_all(&broker.topology.receipts_queue)
        .await
        .iter()
        .map(|message| message.message_id.parse().unwrap())
        .collect();
    let queued_set: HashSet<i64> = queued.iter().copied().collect();
    assert_eq!(queued.len(), queued_set.len(), "nothing published twice");
    assert!(
        staged.is_disjoint(&queued_set),
        "nothing both published and still staged"
    );
    let accounted: HashSet<i64> = staged.union(&queued_set).copied().collect();
    assert_eq!(accounted, all, "every job is staged or published");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_the_receipt_worker_finish_in_flight_mail_and_loses_none() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let user = app.create_user(GOOD_CARD).await;
    const RIDES: usize = 40;
    for _ in 0..RIDES {
        app.create_ride(&user, &new_key(), ride_request())
            .await
            .unwrap();
    }
    let enqueued = common::enqueuer(&app.pool, &broker, 100)
        .run_once()
        .await
        .unwrap();
    assert_eq!(enqueued.published, RIDES as u64);
    let child = spawn_worker(
        "receipts",
        app.db.url(),
        &broker,
        &[("SMTP_URL", &sink.smtp_url()), ("RECEIPTS_PREFETCH", "4")],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while sink.received().is_empty() {
        assert!(Instant::now() < deadline, "the receipt worker sent nothing");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    terminate(child).await;

    let mails = sink.received();
    let mailed: HashSet<_> = mails.iter().map(|mail| mail.message_id()).collect();
    assert_eq!(mailed.len(), mails.len(), "no ride mailed twice");
    let mut conn = app.pool.get().await.unwrap();
    let recorded: i64 = schema::schema::sent_receipts::table
        .count()
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        recorded as usize,
        mails.len(),
        "every mail sent was recorded, and acked"
    );
    let left = broker.take_all(&broker.topology.receipts_queue).await.len();
    assert_eq!(
        mails.len() + left,
        RIDES,
        "every receipt is mailed or still queued"
    );
    assert!(
        broker
            .take_all(&broker.topology.dead_letter_queue)
            .await
            .is_empty(),
        "nothing dead-lettered by the shutdown"
    );
    broker.cleanup().await;
}

/// `rides_receipts_messages_total{outcome="sent"}` as the worker's `/metrics` shows it now.
async fn receipts_sent_counter(metrics_port: u16) -> u64 {
    let Ok(response) = reqwest::get(format!("http://127.0.0.1:{metrics_port}/metrics")).await
    else {
        return 0;
    };
    let text = response.text().await.unwrap_or_default();
    text.lines()
        .filter(|line| {
            line.starts_with("rides_receipts_messages_total{") && line.contains(r#"outcome="sent""#)
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_receipt_workers_metrics_count_every_mail_once_the_queue_is_drained() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let sink = common::mail_sink().await;
    let user = app.create_user(GOOD_CARD).await;
    const RIDES: usize = 40;
    for _ in 0..RIDES {
        app.create_ride(&user, &new_key(), ride_request())
            .await
            .unwrap();
    }
    let enqueued = common::enqueuer(&app.pool, &broker, 100)
        .run_once()
        .await
        .unwrap();
    assert_eq!(enqueued.published, RIDES as u64);
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let child = spawn_worker(
        "receipts",
        app.db.url(),
        &broker,
        &[
            ("SMTP_URL", &sink.smtp_url()),
            ("METRICS_LISTEN_ADDR", &metrics_addr),
        ],
    );
    // Nothing more arrives once these are mailed: the counter must still reach every one.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut counted = 0;
    while sink.received().len() < RIDES || counted < RIDES as u64 {
        assert!(
            Instant::now() < deadline,
            "{} of {RIDES} mailed, {counted} counted as sent by /metrics",
            sink.received().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        counted = receipts_sent_counter(metrics_port).await;
    }
    assert_eq!(counted, RIDES as u64, "each mail counted once");

    terminate(child).await;
    broker.cleanup().await;
}
