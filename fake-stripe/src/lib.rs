//! `fake-stripe`: a small, faithful stand-in for Stripe's PaymentIntents API.
//!
//! It is the payment provider for our tests and for local development: the api-server's
//! Stripe client talks to it exactly as it would to `api.stripe.com` (form-encoded bodies,
//! Bearer auth, `Idempotency-Key`), and gets Stripe-shaped answers, declines and errors.
//! On top of that it can inject faults (500s, hangs, charge-then-drop) so retry and
//! reconciliation logic can be tested against the failure modes that lose money.
//!
//! Layout:
//! - `lib.rs` (this file): [`Config`], the [`FakeStripe`] handle used in-process by tests,
//!   and [`serve`], the accept loop with graceful shutdown used by the binary.
//! - `state.rs`: the in-memory ledger, idempotency store and fault queue.
//! - `api.rs`: HTTP routing, auth, validation and Stripe-shaped JSON.
//! - `refunds.rs`: `POST /v1/refunds` and `GET /v1/refunds`.
//!
//! hyper is used directly (not a framework) because faults need to close a connection
//! without a response, and to hold one open without answering.

mod api;
mod refunds;
mod state;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};

use state::State;
pub use state::{FaultMode, PaymentIntent, Refund};

/// How long shutdown waits for in-flight requests (e.g. ones sleeping for `latency`)
/// before cutting their connections.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Server configuration.
#[derive(Clone)]
pub struct Config {
    /// The only secret key accepted. `None` accepts any `sk_test_...` key, which is what
    /// most tests want: each test can use its own key to get its own idempotency scope.
    pub api_key: Option<String>,
    /// How long an idempotency key is remembered, from its first use (Stripe: 24 h).
    pub idempotency_window: Duration,
    /// Simulated provider latency for each executed `POST /v1/payment_intents`.
    pub latency: Duration,
    /// The extra latency of a call hit by the `slow` fault.
    pub slow_fault_delay: Duration,
    /// Characters of a refund id after `re_` (Stripe's: 24). A test sets more to see an id longer
    /// than the service's columns handled.
    pub refund_id_len: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            api_key: None,
            idempotency_window: Duration::from_secs(24 * 60 * 60),
            latency: Duration::ZERO,
            slow_fault_delay: Duration::from_secs(8),
            refund_id_len: 24,
        }
    }
}

/// Hand-written so the API key can never end up in a log line via `{:?}`.
impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("idempotency_window", &self.idempotency_window)
            .field("latency", &self.latency)
            .field("slow_fault_delay", &self.slow_fault_delay)
            .field("refund_id_len", &self.refund_id_len)
            .finish()
    }
}

/// A running fake Stripe server. Dropping it stops the server (in the background);
/// [`FakeStripe::shutdown`] stops it and waits until every connection is closed.
pub struct FakeStripe {
    addr: SocketAddr,
    state: Arc<State>,
    /// Dropping the sender is the shutdown signal, so plain `drop` also stops the server.
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl FakeStripe {
    /// Starts a server on an ephemeral loopback port.
    pub async fn spawn(config: Config) -> std::io::Result<FakeStripe> {
        Self::bind(SocketAddr::from(([127, 0, 0, 1], 0)), config).await
    }

    /// Starts a server on `addr`.
    pub async fn bind(addr: SocketAddr, config: Config) -> std::io::Result<FakeStripe> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = State::new(config);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_state(listener, Arc::clone(&state), async move {
            let _ = stopped.await;
        }));
        Ok(FakeStripe {
            addr,
            state,
            stop,
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, to use as the Stripe API base URL.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Snapshot of every PaymentIntent created (succeeded, declined, unconfirmed), oldest first.
    pub fn payment_intents(&self) -> Vec<PaymentIntent> {
        self.state.payment_intents()
    }

    /// Number of PaymentIntents with status `succeeded`: money actually taken.
    pub fn succeeded_charges(&self) -> usize {
        self.state
            .payment_intents()
            .iter()
            .filter(|pi| pi.status == "succeeded")
            .count()
    }

    /// Snapshot of every refund made, oldest first.
    pub fn refunds(&self) -> Vec<Refund> {
        self.state.refunds()
    }

    /// Moves a PaymentIntent's `created` to `created` (Unix seconds), so a test can place a
    /// charge in a window of time. Stripe has no such call; our clients never make it. Returns
    /// false for an unknown id.
    pub fn backdate(&self, id: &str, created: i64) -> bool {
        self.state.backdate(id, created)
    }

    /// Every `POST /v1/payment_intents` received, including replays, rejects and faulted ones.
    pub fn create_calls(&self) -> usize {
        self.state.create_calls()
    }

    /// Queues `count` faults for the next `POST /v1/payment_intents` calls.
    pub fn inject_faults(&self, mode: FaultMode, count: usize) {
        self.state.inject_faults(mode, count);
    }

    /// The next `count` `GET /v1/payment_intents/{id}` calls answer 500 `api_error` (as Stripe
    /// does in an outage) instead of the PaymentIntent; 0 makes them answer again.
    pub fn fail_retrieves(&self, count: usize) {
        self.state.fail_retrieves(count);
    }

    /// Queues `count` faults for the next `POST /v1/payment_intents` calls charging `customer`,
    /// replacing that customer's pending ones (0 clears them); untargeted faults come first.
    pub fn inject_faults_for(&self, customer: &str, mode: FaultMode, count: usize) {
        self.state.inject_faults_for(customer, mode, count);
    }

    pub fn clear_faults(&self) {
        self.state.clear_faults();
    }

    /// Stops accepting, releases connections held by `timeout` faults, and waits (up to a
    /// short grace period) for in-flight requests to finish.
    pub async fn shutdown(self) {
        drop(self.stop);
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "fake-stripe server task failed");
        }
    }
}

/// Serves the fake Stripe API on `listener` until `shutdown` resolves, then closes every
/// connection (including ones held by `timeout` faults) and returns.
pub async fn serve(listener: TcpListener, config: Config, shutdown: impl Future<Output = ()>) {
    serve_state(listener, State::new(config), shutdown).await;
}

async fn serve_state(listener: TcpListener, state: Arc<State>, shutdown: impl Future<Output = ()>) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            // Reap finished connections so the set does not grow during long runs.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    connections.spawn(serve_connection(stream, Arc::clone(&state), stop_rx.clone()));
                }
                Err(e) => {
                    // Usually fd exhaustion under load: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    drop(listener);
    stop_tx.send_replace(true);
    let drain = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drain).await.is_err() {
        tracing::warn!(
            open = connections.len(),
            "closing connections still busy after the grace period"
        );
        connections.shutdown().await;
    }
}

/// Resolves once shutdown has been signalled (or the server is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopping| *stopping).await;
}

async fn serve_connection(stream: TcpStream, state: Arc<State>, stop: watch::Receiver<bool>) {
    let service_stop = stop.clone();
    let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let state = Arc::clone(&state);
        let stop = service_stop.clone();
        async move {
            let method = req.method().clone();
            // Path only: query strings may carry customer ids or metadata.
            let path = req.uri().path().to_owned();
            let result = api::handle(state, stop, req).await;
            match &result {
                Ok(response) => tracing::info!(
                    %method,
                    path,
                    status = response.status().as_u16(),
                    replayed = if response.headers().contains_key("idempotent-replayed") { "yes" } else { "no" },
                    "request"
                ),
                Err(fault) => {
                    tracing::info!(%method, path, outcome = %fault, "request closed without response")
                }
            }
            result
        }
    });
    let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = stopped(stop) => {
            // Idle keep-alive connections close at once; busy ones finish their request.
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection closed with error");
    }
}
