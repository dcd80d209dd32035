//! Shared test fixtures: a private RabbitMQ topology, queue inspection, a severable TCP proxy,
//! staging helpers, and a receipt worker wired to an in-test mail sink.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use api_server::testing::{GOOD_CARD, TestApp, new_key, ride_request};
use contract::{BackgroundJob, ReceiptJob};
use diesel_async::RunQueryDsl;
use lapin::{
    BasicProperties,
    options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions, QueueDeclareOptions},
    types::FieldTable,
};
use mail_sink::MailSink;
use schema::{Pool, models::NewStagedJob, schema::staged_jobs};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::AbortHandle,
};
use workers::{
    amqp::AmqpSession,
    config::{EnqueuerConfig, ReceiptsConfig},
    enqueuer::Enqueuer,
    mailer::Mailer,
    receipts::ReceiptWorker,
    relay_search::RelaySearch,
    topology::Topology,
};

pub const DEADLINE: Duration = Duration::from_secs(30);

pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A topology of its own for one test, deleted by `cleanup`.
pub struct TestBroker {
    pub topology: Topology,
    pub session: AmqpSession,
    /// The broker's URL, which the workers built by these helpers connect to.
    pub url: String,
}

/// A message taken off a queue.
#[derive(Debug)]
pub struct Taken {
    pub message_id: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

impl TestBroker {
    pub async fn new() -> TestBroker {
        TestBroker::with_delivery_limit(5).await
    }

    pub async fn with_delivery_limit(limit: u32) -> TestBroker {
        TestBroker::at(&amqp_url(), limit).await
    }

    /// A topology of its own on the broker at `url`.
    pub async fn at(url: &str, limit: u32) -> TestBroker {
        TestBroker::declaring(url, limit, workers::jobs::registry()).await
    }

    /// A topology of its own that declares the queues of `jobs` (a test's own job types).
    pub async fn declaring(url: &str, limit: u32, jobs: workers::jobs::Registry) -> TestBroker {
        let prefix = format!("test-{}", uuid::Uuid::new_v4().simple());
        let topology = Topology::with_jobs(&prefix, limit, jobs);
        let session = AmqpSession::open(url, &topology).await.unwrap();
        TestBroker {
            topology,
            session,
            url: url.to_owned(),
        }
    }

    /// Takes (and acks) every message currently in `queue`.
    pub async fn take_all(&self, queue: &str) -> Vec<Taken> {
        let mut taken = Vec::new();
        while let Some(message) = self
            .session
            .channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
        {
            let delivery = message.delivery;
            delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .unwrap();
            taken.push(Taken {
                message_id: delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.to_string())
                    .unwrap_or_default(),
                body: delivery.data,
                properties: delivery.properties,
            });
        }
        taken
    }

    pub async fn depth(&self, queue: &str) -> u32 {
        self.session
            .channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }

    /// Waits until `queue` holds at least `count` messages (dead-lettering is asynchronous).
    pub async fn wait_for_depth(&self, queue: &str, count: u32) -> u32 {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let depth = self.depth(queue).await;
            if depth >= count || tokio::time::Instant::now() > deadline {
                return depth;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Publishes a raw body to the receipts routing key, as a foreign producer could.
    pub async fn publish_raw(&self, message_id: &str, body: &[u8]) {
        // On a channel of its own in confirm mode: the broker confirms a publish to a quorum queue
        // once the message is enqueued, so a count read right after, on any connection, sees it
        // (run on 2026-11-26: a depth read on another connection still saw 1 of 2).
        let channel = self.session.connection.create_channel().await.unwrap();
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await
            .unwrap();
        let confirm = channel
            .basic_publish(
                self.topology.exchange.as_str().into(),
                workers::topology::RECEIPT_ROUTING_KEY.into(),
                BasicPublishOptions::default(),
                body,
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(message_id.into()),
            )
            .await
            .unwrap();
        assert!(
            confirm.await.unwrap().is_ack(),
            "the broker took the message"
        );
        let _ = channel.close(200, "published".into()).await;
    }

    pub async fn cleanup(self) {
        self.topology.delete(&self.session.channel).await.unwrap();
        self.session.close().await;
    }
}

pub fn enqueuer_config(batch_size: i64) -> EnqueuerConfig {
    EnqueuerConfig {
        batch_size,
        idle_max: Duration::from_millis(100),
        confirm_timeout: Duration::from_secs(20),
        max_attempts: 20,
        backoff_base: Duration::from_secs(1),
        backoff_max: Duration::from_secs(300),
    }
}

pub fn enqueuer(pool: &Pool, broker: &TestBroker, batch_size: i64) -> Enqueuer {
    Enqueuer::new(
        pool.clone(),
        &broker.url,
        broker.topology.clone(),
        enqueuer_config(batch_size),
    )
}

/// A paid ride whose receipt message is in the broker's receipts queue (published by the
/// enqueuer); returns its id.
pub async fn paid_ride(app: &TestApp, broker: &TestBroker) -> i64 {
    let user = app.create_user(GOOD_CARD).await;
    let response = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap()
        .into_inner();
    let summary = enqueuer(&app.pool, broker, 100).run_once().await.unwrap();
    assert_eq!(summary.published, 1);
    response.ride.unwrap().id
}

pub fn receipt_args(ride_id: i64) -> serde_json::Value {
    serde_json::json!({
        "ride_id": ride_id,
        "user_id": 1,
        "amount": 2000,
        "currency": "usd",
        "charge_id": format!("pi_{ride_id}"),
        "created_at": "2026-11-21T09:00:00Z",
    })
}

/// Stages `count` receipt jobs in one transaction; returns their ids.
pub async fn stage_jobs(pool: &Pool, count: usize) -> Vec<i64> {
    let mut conn = pool.get().await.unwrap();
    let args: Vec<serde_json::Value> = (0..count).map(|i| receipt_args(i as i64 + 1)).collect();
    let empty = serde_json::json!({});
    let rows: Vec<NewStagedJob<'_>> = args
        .iter()
        .map(|job_args| NewStagedJob {
            job_name: ReceiptJob::JOB_NAME,
            job_args,
            trace_context: &empty,
        })
        .collect();
    let mut ids = Vec::new();
    for chunk in rows.chunks(1000) {
        let inserted: Vec<i64> = diesel::insert_into(staged_jobs::table)
            .values(chunk)
            .returning(staged_jobs::id)
            .get_results(&mut conn)
            .await
            .unwrap();
        ids.extend(inserted);
    }
    ids
}

pub async fn staged_ids(pool: &Pool) -> Vec<i64> {
    use diesel::QueryDsl;
    let mut conn = pool.get().await.unwrap();
    staged_jobs::table
        .select(staged_jobs::id)
        .order(staged_jobs::id)
        .load(&mut conn)
        .await
        .unwrap()
}

pub fn receipts_config(smtp_url: &str) -> ReceiptsConfig {
    ReceiptsConfig {
        smtp_url: workers::config::Secret::new(smtp_url),
        from: workers::config::DEFAULT_RECEIPT_FROM.to_owned(),
        smtp_timeout: Duration::from_secs(10),
        prefetch: 4,
        batch_size: 4,
        batch_wait: Duration::from_millis(5),
        smtp_connections: 4,
        retry_base_delay: Duration::from_millis(20),
        retry_max_delay: Duration::from_millis(200),
        mail_search_url: None,
        claim_lease: Duration::from_secs(30),
    }
}

pub async fn mail_sink() -> MailSink {
    MailSink::spawn("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap()
}

pub fn receipt_worker(pool: &Pool, broker: &TestBroker, sink: &MailSink) -> Arc<ReceiptWorker> {
    receipt_worker_with(pool, broker, sink, None)
}

/// A receipt worker that asks `search_url` (the sink's `serve_search`) before re-sending.
pub fn receipt_worker_with(
    pool: &Pool,
    broker: &TestBroker,
    sink: &MailSink,
    search_url: Option<&str>,
) -> Arc<ReceiptWorker> {
    receipt_worker_configured(pool, broker, sink, search_url, |_| {})
}

/// [`receipt_worker_with`], its configuration changed by `adjust` first.
pub fn receipt_worker_configured(
    pool: &Pool,
    broker: &TestBroker,
    sink: &MailSink,
    search_url: Option<&str>,
    adjust: impl FnOnce(&mut ReceiptsConfig),
) -> Arc<ReceiptWorker> {
    let mut config = receipts_config(&sink.smtp_url());
    adjust(&mut config);
    config.mail_search_url = search_url.map(str::to_owned);
    let mailer = Mailer::with_connections(
        config.smtp_url.expose(),
        &config.from,
        config.smtp_timeout,
        config.smtp_connections,
    )
    .unwrap();
    let search = search_url.map(|url| RelaySearch::new(url, Duration::from_secs(5)).unwrap());
    ReceiptWorker::new(
        pool.clone(),
        mailer,
        search,
        broker.topology.clone(),
        config,
    )
}

/// A TCP proxy the test can sever (every connection dropped, new ones refused) and restore,
/// standing in for a broker that goes away. Optionally severs by itself after forwarding a
/// number of client bytes, to cut a connection in the middle of a drain deterministically.
pub struct Proxy {
    pub addr: SocketAddr,
    severed: Arc<AtomicBool>,
    budget: Arc<AtomicI64>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    accepted: Arc<AtomicUsize>,
    accept: AbortHandle,
}

impl Proxy {
    pub async fn spawn(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let severed = Arc::new(AtomicBool::new(false));
        let budget = Arc::new(AtomicI64::new(i64::MAX));
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accepted = Arc::new(AtomicUsize::new(0));
        let accept = {
            let (severed, budget, connections, accepted) = (
                severed.clone(),
                budget.clone(),
                connections.clone(),
                accepted.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    if AtomicBool::load(&severed, Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let task = tokio::spawn(pipe(
                        client,
                        server,
                        severed.clone(),
                        budget.clone(),
                        connections.clone(),
                    ));
                    connections.lock().unwrap().push(task.abort_handle());
                }
            })
            .abort_handle()
        };
        Proxy {
            addr,
            severed,
            budget,
            connections,
            accepted,
            accept,
        }
    }

    /// Connections forwarded so far.
    pub fn accepted(&self) -> usize {
        AtomicUsize::load(&self.accepted, Ordering::SeqCst)
    }

    /// Closes every open connection, as a server dropping its clients; new ones still pass.
    pub fn drop_connections(&self) {
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// Severs after `bytes` more bytes from the client have been forwarded.
    pub fn sever_after(&self, bytes: i64) {
        self.budget.store(bytes, Ordering::SeqCst);
    }

    pub fn restore(&self) {
        self.budget.store(i64::MAX, Ordering::SeqCst);
        self.severed.store(false, Ordering::SeqCst);
    }

    pub fn is_severed(&self) -> bool {
        AtomicBool::load(&self.severed, Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        sever(&self.severed, &self.connections);
    }
}

fn sever(severed: &AtomicBool, connections: &Mutex<Vec<AbortHandle>>) {
    severed.store(true, Ordering::SeqCst);
    for connection in connections.lock().unwrap().drain(..) {
        connection.abort();
    }
}

async fn pipe(
    client: TcpStream,
    server: TcpStream,
    severed: Arc<AtomicBool>,
    budget: Arc<AtomicI64>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let mut buffer = vec![0_u8; 16 * 1024];
        loop {
            let n = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let left = budget.fetch_sub(n as i64, Ordering::SeqCst) - n as i64;
            if left < 0 {
                // Forward nothing more: the connection dies mid-stream.
                sever(&severed, &connections);
                return;
            }
            if server_write.write_all(&buffer[..n]).await.is_err() {
                return;
            }
        }
    };
    let downstream = async {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
    };
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}

/// The RabbitMQ address behind `amqp_url()`, for the proxy.
pub fn broker_addr() -> SocketAddr {
    let url = amqp_url();
    let authority = url
        .trim_start_matches("amqp://")
        .split('/')
        .next()
        .unwrap()
        .rsplit('@')
        .next()
        .unwrap()
        .to_owned();
    let authority = if authority.contains(':') {
        authority
    } else {
        format!("{authority}:5672")
    };
    std::net::ToSocketAddrs::to_socket_addrs(&authority)
        .unwrap()
        .next()
        .unwrap()
}
