//! A claim whose commit landed but whose answer was lost (the primary died after its synchronous
//! standby had the commit) leaves its key locked by a token no other attempt knows. The server
//! that made it undoes it in the background (`Rides::claim_failed`), so the caller's retry is
//! served at once rather than refused `IDEMPOTENCY_KEY_IN_USE` until the lock times out (90 s).
//!
//! The loss is made real: the api-server reaches PostgreSQL through [`CuttingProxy`], which lets
//! the claim's statement through, keeps its answer, then cuts every connection and refuses new
//! ones for a moment (the failover), so the claim's redo fails too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use api_server::{grpc::reason, testing::*};
use schema::{RecoveryPoint, models::IdempotencyKeyRow as KeyRow, testing::TestDatabase};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{Notify, watch},
};
use tonic::Code;

/// How long the proxy refuses connections after the cut: ten times the api-server's pool timeout
/// below, so the claim's redo finds no database even on a loaded machine.
const DOWN_FOR: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_committed_but_unanswered_is_undone_in_the_background_and_the_retry_served() {
    let db = TestDatabase::new().await;
    let upstream = db
        .url()
        .split_once('@')
        .and_then(|(_, rest)| rest.split_once('/'))
        .map(|(host_port, _)| host_port.to_owned())
        .expect("the test database URL names host:port");
    let proxy = CuttingProxy::start(upstream.clone()).await;
    let proxied_url = db.url().replace(&upstream, &proxy.addr.to_string());
    let app = TestApp::spawn_on(
        db,
        &proxied_url,
        fake_stripe::Config::default(),
        &[
            ("DATABASE_POOL_TIMEOUT_MS", "300"),
            ("IDEMPOTENCY_LOCK_TIMEOUT_SECS", "90"),
        ],
    )
    .await;
    let rider = app.create_user(GOOD_CARD).await;
    let key = new_key();

    // The claim's statement binds the key: its answer is kept and every connection cut.
    proxy.cut_after_a_message_holding(key.as_bytes());
    let lost = app
        .create_ride(&rider, &key, ride_request())
        .await
        .unwrap_err();
    assert_eq!(
        proxy.cuts(),
        1,
        "the claim's statement went through the proxy"
    );
    assert_status(&lost, Code::Unavailable, reason::DATABASE_UNAVAILABLE);

    // The claim committed, locked by the lost attempt's token; the server undoes it once the
    // database is back.
    let row = wait_for_unlocked(&app, &rider, &key).await;
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated);
    assert_eq!(row.lock_token, None);

    // The retry is served at once: one ride, charged once, for the key.
    let started = Instant::now();
    let ride = app.create_ride(&rider, &key, ride_request()).await.unwrap();
    assert!(
        !replayed(&ride),
        "the retry resumed the key, it did not replay it"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "served without waiting for the 90 s lock timeout"
    );
    assert_eq!(
        app.rides().await.len(),
        1,
        "the lost claim's ride is the ride"
    );
    assert_eq!(app.stripe.succeeded_charges(), 1);
    let row = app.key_row(&rider, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
}

/// Polls until the key exists and no attempt holds it; panics after 20 s (the background unlock
/// retries from 0.1 s, doubling to 2 s).
async fn wait_for_unlocked(app: &TestApp, rider: &TestUser, key: &str) -> KeyRow {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let row = app.key_row(rider, key).await;
        match row {
            Some(row) if row.locked_at.is_none() => return row,
            Some(row) if Instant::now() > deadline => {
                panic!("key still locked after 20 s: {row:?}")
            }
            None if Instant::now() > deadline => panic!("the lost claim did not commit"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// PostgreSQL's ReadyForQuery message up to its status byte: sent once a statement's implicit
/// transaction is over.
const READY_FOR_QUERY: &[u8] = &[b'Z', 0, 0, 0, 5];

/// A TCP proxy to PostgreSQL that, once armed, forwards the first client message holding a
/// pattern and keeps the server's answer from the client; once the server has committed, it
/// closes every connection and refuses new ones for [`DOWN_FOR`].
struct CuttingProxy {
    addr: SocketAddr,
    state: Arc<ProxyState>,
}

struct ProxyState {
    armed: Mutex<Option<Vec<u8>>>,
    down_until: Mutex<Option<Instant>>,
    cuts: AtomicUsize,
    /// Bumped at every cut: every connection ends when it changes.
    generation: watch::Sender<u64>,
}

impl CuttingProxy {
    async fn start(upstream: String) -> CuttingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ProxyState {
            armed: Mutex::new(None),
            down_until: Mutex::new(None),
            cuts: AtomicUsize::new(0),
            generation: watch::channel(0).0,
        });
        let accepting = Arc::clone(&state);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let down = accepting
                    .down_until
                    .lock()
                    .unwrap()
                    .is_some_and(|until| Instant::now() < until);
                if down {
                    drop(client);
                    continue;
                }
                tokio::spawn(relay(client, upstream.clone(), Arc::clone(&accepting)));
            }
        });
        CuttingProxy { addr, state }
    }

    fn cut_after_a_message_holding(&self, pattern: &[u8]) {
        *self.state.armed.lock().unwrap() = Some(pattern.to_vec());
    }

    fn cuts(&self) -> usize {
        self.state.cuts.load(Ordering::SeqCst)
    }
}

async fn relay(client: TcpStream, upstream: String, state: Arc<ProxyState>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let mut cut = state.generation.subscribe();
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let answer_kept = Arc::new(AtomicBool::new(false));
    let keep = Arc::clone(&answer_kept);
    let committed = Notify::new();
    let to_server = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(());
            }
            let chunk = &buf[..n];
            let matched = {
                let mut armed = state.armed.lock().unwrap();
                let hit = armed
                    .as_deref()
                    .is_some_and(|pattern| chunk.windows(pattern.len()).any(|w| w == pattern));
                if hit {
                    *armed = None;
                }
                hit
            };
            if matched {
                keep.store(true, Ordering::SeqCst);
            }
            server_write.write_all(chunk).await?;
            if matched {
                // Cut once the server said ReadyForQuery: the statement's implicit transaction
                // has committed, and the "primary" is gone before its answer reached anyone.
                let _ = tokio::time::timeout(Duration::from_secs(10), committed.notified()).await;
                *state.down_until.lock().unwrap() = Some(Instant::now() + DOWN_FOR);
                state.cuts.fetch_add(1, Ordering::SeqCst);
                state.generation.send_modify(|g| *g += 1);
            }
        }
    };
    let to_client = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut kept = Vec::new();
        loop {
            let n = server_read.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(());
            }
            if !answer_kept.load(Ordering::SeqCst) {
                client_write.write_all(&buf[..n]).await?;
                continue;
            }
            kept.extend_from_slice(&buf[..n]);
            if kept
                .windows(READY_FOR_QUERY.len())
                .any(|w| w == READY_FOR_QUERY)
            {
                committed.notify_one();
            }
        }
    };
    tokio::select! {
        _ = to_server => {}
        _ = to_client => {}
        _ = cut.changed() => {}
    }
}
