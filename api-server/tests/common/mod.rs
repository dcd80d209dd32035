//! What the cross-process tests share: a provider slow enough to be caught mid-charge, the real
//! api-server binary as a second server on the same database, and polling for a state.
// Each test binary that includes this module uses a part of it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::{
    process::{Child, Command, Stdio},
    time::Duration,
};

use api_server::testing::*;
use proto::v1::{CreateRideResponse, ride_service_client::RideServiceClient};
use tonic::{Response, Status, transport::Channel};

/// The provider's latency in these tests: long enough that a duplicate sent once the first
/// attempt is at the provider arrives while it is still there.
pub const PROVIDER_LATENCY: Duration = Duration::from_millis(1500);

pub async fn app_with_a_slow_provider(overrides: &[(&str, &str)]) -> TestApp {
    TestApp::spawn_with(
        fake_stripe::Config {
            latency: PROVIDER_LATENCY,
            ..Default::default()
        },
        overrides,
    )
    .await
}

/// Polls until `done` (the fake provider or the database reached a state), for at most a minute.
pub async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    for _ in 0..6000 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened: {what}");
}

/// The first attempt of `key`, sent through `client` in a task of its own; returns once that
/// attempt is at the provider.
pub async fn first_attempt_at_the_provider(
    app: &TestApp,
    mut client: RideServiceClient<Channel>,
    user: &TestUser,
    key: &str,
) -> FirstAttempt {
    let request = authed(&user.token, Some(key), ride_request());
    let first = tokio::spawn(async move { client.create_ride(request).await });
    until("the first attempt reached the provider", async || {
        app.stripe.create_calls() == 1
    })
    .await;
    first
}

pub type FirstAttempt = tokio::task::JoinHandle<Result<Response<CreateRideResponse>, Status>>;

/// A second api-server, the real binary, on `app`'s database and provider, with `env` on top of
/// the harness's settings; and a client of it once it serves. Killed when dropped.
pub async fn spawn_second_server(
    app: &TestApp,
    env: &[(&str, &str)],
) -> (Killed, RideServiceClient<Channel>) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_api-server"));
    command
        .arg("serve")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", app.db.url())
        .env("STRIPE_API_BASE", app.stripe.base_url())
        // The harness's key: the provider's idempotency is per API key.
        .env("STRIPE_SECRET_KEY", "sk_test_harness")
        .env("STRIPE_TIMEOUT_MS", "2000")
        .env("GRPC_LISTEN_ADDR", format!("127.0.0.1:{port}"))
        .env("METRICS_LISTEN_ADDR", "off")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (name, value) in UNLIMITED.iter().chain(env) {
        command.env(name, value);
    }
    // Killed on every path, the test's failures included.
    let child = Killed(command.spawn().unwrap());
    let endpoint = format!("http://127.0.0.1:{port}");
    for _ in 0..400 {
        if let Ok(client) = RideServiceClient::connect(endpoint.clone()).await {
            return (child, client);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the second api-server did not come up");
}

pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
