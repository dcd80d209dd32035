//! The accept loop when the process has no file descriptor left (EMFILE): it must pause and
//! retry, not spin, and take the waiting connections once descriptors come back.
//!
//! This test lowers the process's own open-file limit, so it lives alone in its binary: nothing
//! else runs in the process it starves.

use std::{
    net::TcpStream,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use tracing_subscriber::{Layer, layer::SubscriberExt};

/// Counts the accept loop's warnings: one per pause.
struct CountPauses(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> Layer<S> for CountPauses {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

const EMFILE: i32 = 24;

#[tokio::test(flavor = "current_thread")]
async fn out_of_descriptors_the_accept_loop_pauses_and_then_recovers() {
    let pauses = Arc::new(AtomicUsize::new(0));
    let _subscriber = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(CountPauses(Arc::clone(&pauses))),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();

    // Leave a few descriptors, then take them all with client sockets: the kernel completes
    // their handshakes into the listen backlog, but the process cannot accept any of them.
    let open_now = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let hard = getrlimit(Resource::Nofile).maximum;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(open_now + 8),
            maximum: hard,
        },
    )
    .unwrap();
    let mut clients = Vec::new();
    loop {
        match TcpStream::connect(addr) {
            Ok(client) => clients.push(client),
            Err(error) if error.raw_os_error() == Some(EMFILE) => break,
            Err(error) => panic!("unexpected connect error: {error}"),
        }
        assert!(clients.len() < 64, "the lowered limit was not enforced");
    }
    assert!(!clients.is_empty());

    // For 600 ms every accept fails with EMFILE. Pausing 5 ms, doubling, the loop tries about
    // seven times; one that retried at once would try many thousands of times.
    let starved = tokio::time::timeout(
        Duration::from_millis(600),
        telemetry::accept::accept(&listener),
    )
    .await;
    assert!(
        starved.is_err(),
        "nothing can be accepted without a descriptor"
    );
    let paused = pauses.load(Ordering::Relaxed);
    assert!(paused >= 1, "the loop never saw EMFILE");
    assert!(paused <= 20, "the loop spun: {paused} retries in 600 ms");

    // Descriptors come back: a waiting connection is taken (the pause is at most 1 s; the
    // timeout only keeps a broken loop from hanging the test).
    clients.truncate(clients.len() / 2);
    let (_stream, peer) = tokio::time::timeout(
        Duration::from_secs(30),
        telemetry::accept::accept(&listener),
    )
    .await
    .expect("accepted once descriptors were free");
    assert!(peer.ip().is_loopback());
}
