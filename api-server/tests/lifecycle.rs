//! The process around the API: health that follows the database, draining on shutdown, and the
//! real binary's metrics endpoint, logs and SIGTERM handling.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use api_server::{grpc::reason, testing::*};
use tonic::Code;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

async fn health(channel: tonic::transport::Channel) -> ServingStatus {
    health_of(channel, "rides.v1.RideService").await
}

async fn health_of(channel: tonic::transport::Channel, service: &str) -> ServingStatus {
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    ServingStatus::try_from(status).unwrap()
}

async fn wait_for_health(
    channel: &tonic::transport::Channel,
    wanted: ServingStatus,
) -> ServingStatus {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let status = health(channel.clone()).await;
        if status == wanted || Instant::now() > deadline {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn health_is_not_serving_while_the_database_is_unreachable() {
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[
            (
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:1/unreachable",
            ),
            ("DATABASE_POOL_TIMEOUT_MS", "300"),
            ("HEALTH_CHECK_INTERVAL_MS", "50"),
        ],
    )
    .await;
    let channel = app.channel().await;

    assert_eq!(
        wait_for_health(&channel, ServingStatus::NotServing).await,
        ServingStatus::NotServing
    );
    assert_eq!(
        health_of(channel.clone(), "").await,
        ServingStatus::NotServing
    );
    // The process itself is fine: a liveness probe must not restart it for the database's sake.
    assert_eq!(
        health_of(channel.clone(), api_server::server::LIVENESS_SERVICE).await,
        ServingStatus::Serving
    );
    // And a call says why, with a hint to retry. (A token of the right shape: any other is
    // refused without the database.)
    let user = TestUser {
        id: 0,
        token: format!("rr_{}", "A".repeat(43)),
    };
    let status = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::Unavailable, reason::DATABASE_UNAVAILABLE);
}

/// A server whose liveness session goes through a proxy that `up` switches, checking its
/// database every 50 ms; and the proxy's count of the connections asked of it.
async fn behind_a_liveness_proxy(up: &Arc<AtomicBool>) -> (TestApp, Arc<AtomicUsize>) {
    let db = schema::testing::TestDatabase::new().await;
    let url = db.url().to_owned();
    let (liveness_url, tries) = schema::testing::through_switchable_proxy(&url, up).await;
    let overrides = [
        ("DATABASE_LIVENESS_URL", liveness_url.as_str()),
        ("HEALTH_CHECK_INTERVAL_MS", "50"),
    ];
    let app = TestApp::spawn_on(db, &url, fake_stripe::Config::default(), &overrides).await;
    (app, tries)
}

/// Not ready while the database answers and the liveness session does not: a lock taken then
/// would name no holder, and its key would outlast this server's death by the lock timeout.
async fn assert_not_ready_without_a_liveness_session(app: &TestApp, tries: &AtomicUsize) {
    let channel = app.channel().await;
    // The pool is fine: a call is served.
    let user = app.create_user(GOOD_CARD).await;
    app.create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap();
    assert!(
        AtomicUsize::load(tries, Ordering::SeqCst) >= 1,
        "the session was tried"
    );
    for service in ["rides.v1.RideService", ""] {
        assert_eq!(
            health_of(channel.clone(), service).await,
            ServingStatus::NotServing,
            "{service:?} before the liveness session stands"
        );
    }
    assert!(!*app.app.readiness().borrow());
}

#[tokio::test(flavor = "multi_thread")]
async fn health_turns_serving_only_once_the_liveness_session_stands() {
    let up = Arc::new(AtomicBool::new(false));
    let (app, tries) = behind_a_liveness_proxy(&up).await;
    assert_not_ready_without_a_liveness_session(&app, &tries).await;
    up.store(true, Ordering::SeqCst);
    let channel = app.channel().await;
    assert_eq!(
        wait_for_health(&channel, ServingStatus::Serving).await,
        ServingStatus::Serving
    );
    let holder = app.rides.locking().liveness.holder_for_lock().await;
    assert!(holder.is_some(), "serving, and its locks name a holder");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_liveness_session_that_never_opens_delays_serving_once_and_no_longer() {
    let up = Arc::new(AtomicBool::new(false));
    let (app, tries) = behind_a_liveness_proxy(&up).await;
    assert_not_ready_without_a_liveness_session(&app, &tries).await;
    // After FIRST_SESSION_WAIT health follows the database alone.
    let channel = app.channel().await;
    assert_eq!(
        wait_for_health(&channel, ServingStatus::Serving).await,
        ServingStatus::Serving
    );
    assert_eq!(app.rides.locking().liveness.holder_for_lock().await, None);
}

#[tokio::test(flavor = "multi_thread")]
async fn draining_reports_not_serving_while_still_answering() {
    let mut app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[
            ("SHUTDOWN_DRAIN_DELAY_MS", "2000"),
            ("HEALTH_CHECK_INTERVAL_MS", "50"),
        ],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let channel = app.channel().await;
    assert_eq!(
        wait_for_health(&channel, ServingStatus::Serving).await,
        ServingStatus::Serving
    );

    let server = app.begin_shutdown().unwrap();

    assert_eq!(
        wait_for_health(&channel, ServingStatus::NotServing).await,
        ServingStatus::NotServing
    );
    // Callers that have not noticed yet are still answered during the drain delay.
    let mut client = proto::v1::ride_service_client::RideServiceClient::new(channel.clone());
    client
        .create_ride(authed(&user.token, Some(&new_key()), ride_request()))
        .await
        .expect("answered while draining");
    tokio::time::timeout(Duration::from_secs(15), server)
        .await
        .expect("the server stops after the drain")
        .unwrap();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The real api-server binary, serving on free loopback ports, and a client connected to it.
struct ServedBinary {
    child: std::process::Child,
    grpc_port: u16,
    metrics_port: u16,
    client: proto::v1::ride_service_client::RideServiceClient<tonic::transport::Channel>,
}

impl ServedBinary {
    async fn start(
        db: &schema::testing::TestDatabase,
        stripe: &fake_stripe::FakeStripe,
        env: &[(&str, &str)],
    ) -> ServedBinary {
        let (grpc_port, metrics_port) = (free_port(), free_port());
        let mut child = Command::new(env!("CARGO_BIN_EXE_api-server"))
            .arg("serve")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("DATABASE_URL", db.url())
            .env("STRIPE_API_BASE", stripe.base_url())
            .env("STRIPE_SECRET_KEY", "sk_test_binary_secret")
            .env("GRPC_LISTEN_ADDR", format!("127.0.0.1:{grpc_port}"))
            .env("METRICS_LISTEN_ADDR", format!("127.0.0.1:{metrics_port}"))
            .env("LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let endpoint = format!("http://127.0.0.1:{grpc_port}");
        for _ in 0..200 {
            if let Ok(client) =
                proto::v1::ride_service_client::RideServiceClient::connect(endpoint.clone()).await
            {
                return ServedBinary {
                    child,
                    grpc_port,
                    metrics_port,
                    client,
                };
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the server did not come up on {endpoint}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_binary_serves_metrics_logs_trace_ids_and_drains_on_sigterm() {
    const INTERNAL_SECRET: &str = "internal-credential-that-must-never-be-logged";
    let db = schema::testing::TestDatabase::new().await;
    let stripe = fake_stripe::FakeStripe::spawn(fake_stripe::Config::default())
        .await
        .unwrap();
    let pool = db.pool(2);
    let (_, token) = api_server::auth::create_user(&pool, "bin@example.com", "cus_bin", GOOD_CARD)
        .await
        .unwrap();
    let served =
        ServedBinary::start(&db, &stripe, &[("INTERNAL_API_TOKEN", INTERNAL_SECRET)]).await;
    let (mut child, metrics_port) = (served.child, served.metrics_port);
    let mut client = served.client;

    let key = new_key();
    client
        .create_ride(authed(&token, Some(&key), ride_request()))
        .await
        .unwrap();
    // A provider outage is logged inside the request: that line must carry the trace id.
    stripe.inject_faults(fake_stripe::FaultMode::Error500, 1);
    let unavailable = client
        .create_ride(authed(&token, Some(&new_key()), ride_request()))
        .await
        .unwrap_err();
    assert_eq!(unavailable.code(), Code::Unavailable);

    assert_serves_the_metrics(metrics_port).await;

    // SIGHUP reloads certificates; without TLS it must not end the process (its default).
    Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP ended the server"
    );
    client
        .create_ride(authed(&token, Some(&new_key()), ride_request()))
        .await
        .unwrap();

    let status = terminate(&mut child).await;
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");

    let mut logs = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut logs).unwrap();
    assert_logs_carry_trace_ids_and_no_secret(
        &logs,
        &[
            token.as_str(),
            key.as_str(),
            "sk_test_binary_secret",
            INTERNAL_SECRET,
        ],
    );
}

/// The metrics endpoint serves the RPC, phase, provider and pool series, labelled by method.
async fn assert_serves_the_metrics(metrics_port: u16) {
    let metrics = reqwest::get(format!("http://127.0.0.1:{metrics_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for series in [
        "rpc_server_call_duration_seconds_count",
        "rides_phase_duration_seconds_count",
        "rides_payment_provider_duration_seconds_count",
        "db_client_connection_count",
    ] {
        assert!(
            metrics.contains(series),
            "{series} missing from:\n{metrics}"
        );
    }
    for label in [
        r#"rpc_method="rides.v1.RideService/CreateRide""#,
        r#"rpc_system_name="grpc""#,
        r#"rpc_response_status_code="UNAVAILABLE""#,
        r#"db_client_connection_pool_name="api-server""#,
    ] {
        assert!(metrics.contains(label), "{label} missing from:\n{metrics}");
    }
}

/// Sends SIGTERM and waits up to 20 s for the process to exit.
async fn terminate(child: &mut std::process::Child) -> std::process::ExitStatus {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The provider outage's line carries its request's trace id, shutdown and the reload without
/// TLS are logged, and none of `secrets` is.
fn assert_logs_carry_trace_ids_and_no_secret(logs: &str, secrets: &[&str]) {
    let outage = logs
        .lines()
        .find(|line| line.contains("payment provider unavailable"))
        .unwrap_or_else(|| panic!("no outage line in:\n{logs}"));
    let line: serde_json::Value = serde_json::from_str(outage).unwrap();
    let trace_id = line["spans"][0]["trace_id"].as_str().unwrap_or_default();
    assert_eq!(trace_id.len(), 32, "trace id on the line: {outage}");
    assert!(logs.contains("shutting down"), "{logs}");
    assert!(logs.contains("nothing to reload"), "{logs}");
    for secret in secrets {
        assert!(!logs.contains(secret), "a secret reached the logs");
    }
}

/// A flood of connections while the process is short of descriptors: the server keeps
/// `GRPC_RESERVED_DESCRIPTORS` for its own database and provider sockets, so it refuses the new
/// connections at once (`reserved_descriptors`) and the connection it already serves goes on
/// creating rides. Without the reserve the flood takes the last descriptors and every admitted
/// call stalls until its deadline.
#[tokio::test(flavor = "multi_thread")]
async fn connections_that_would_take_the_reserved_descriptors_are_refused_and_calls_go_on() {
    use rustix::process::{Pid, Resource, Rlimit, prlimit};
    const HEADROOM: u64 = 40;
    let db = schema::testing::TestDatabase::new().await;
    let stripe = fake_stripe::FakeStripe::spawn(fake_stripe::Config::default())
        .await
        .unwrap();
    let pool = db.pool(2);
    let (_, token) = api_server::auth::create_user(&pool, "fd@example.com", "cus_fd", GOOD_CARD)
        .await
        .unwrap();
    let mut served = ServedBinary::start(&db, &stripe, &[]).await;
    served
        .client
        .create_ride(authed(&token, Some(&new_key()), ride_request()))
        .await
        .unwrap();

    let pid = Pid::from_raw(i32::try_from(served.child.id()).unwrap()).unwrap();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64;
    // The server raised its soft limit to the hard one at start; the hard one is ours too.
    let hard = rustix::process::getrlimit(Resource::Nofile).maximum;
    let lowered = |soft| {
        prlimit(
            Some(pid),
            Resource::Nofile,
            Rlimit {
                current: soft,
                maximum: hard,
            },
        )
    };
    lowered(Some(open + HEADROOM)).unwrap();
    let flood: Vec<std::net::TcpStream> = (0..3 * HEADROOM)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", served.grpc_port)).ok())
        .collect();
    for _ in 0..5 {
        served
            .client
            .create_ride(authed(&token, Some(&new_key()), ride_request()))
            .await
            .unwrap();
    }
    // Each flooding connection was closed by the server without a byte: read sees the end.
    for mut conn in flood {
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut byte = [0_u8; 1];
        let read = std::io::Read::read(&mut conn, &mut byte);
        assert!(
            matches!(read, Ok(0))
                || read.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "a flooding connection was held open"
        );
    }
    lowered(hard).unwrap();
    let metrics = reqwest::get(format!("http://127.0.0.1:{}/metrics", served.metrics_port))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("rides_grpc_connections_refused_total")
                && l.contains("reason=\"reserved_descriptors\"")),
        "no reserved_descriptors refusal in:\n{metrics}"
    );
    served.child.kill().unwrap();
    served.child.wait().unwrap();
}

/// A pooled connection whose server went away (a restart, a failover, `pg_terminate_backend`)
/// while it sat idle is replaced when it is checked out, not handed to a request that then fails.
#[tokio::test(flavor = "multi_thread")]
async fn a_pooled_connection_whose_backend_was_terminated_is_replaced_at_check_out() {
    use diesel_async::RunQueryDsl;

    let db = schema::testing::TestDatabase::new().await;
    let pool = db.pool(1);
    let mut conn = pool.get().await.unwrap();
    diesel::sql_query("SELECT 1")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);

    let mut admin = db.connect().await;
    diesel::sql_query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(&mut admin)
    .await
    .unwrap();
    // Let the pooled connection's client read the end of its socket, as it would while idle.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut conn = pool.get().await.unwrap();
    diesel::sql_query("SELECT 1")
        .execute(&mut *conn)
        .await
        .expect("the pool handed out a live connection");
}
