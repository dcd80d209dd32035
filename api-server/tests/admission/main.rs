//! Admission as the service's real callers meet it (`api_server::admission`), over real gRPC
//! against a real database: a backend carrying many cold riders over one connection is served,
//! penalties fall only on failed authentication and never on a peer that presented a valid
//! credential, the internal credential is never shut out, and trusted proxies name their clients.
//! The helpers every module shares (servers, channels from a chosen address, a lock that holds the
//! token lookups back) live here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod cold_riders;
mod peers;
mod penalties;
mod token_lookups;

use std::{net::IpAddr, time::Duration};

use api_server::testing::*;
use diesel_async::{AsyncConnection, RunQueryDsl};
use proto::v1::CreateRideResponse;
use tokio::io::AsyncWriteExt;
use tonic::{Response, Status, transport::Channel};

async fn spawn(stripe: fake_stripe::Config, overrides: &[(&str, &str)]) -> TestApp {
    TestApp::spawn_with(stripe, overrides).await
}

/// A server whose peers may fail authentication 4 times (a refill of 1 a second) before they
/// are shut out for a minute.
async fn spawn_with_a_budget_of_four(overrides: &[(&str, &str)]) -> TestApp {
    let mut vars = vec![
        ("GRPC_REFUSALS_PER_IP_PER_SEC", "1"),
        ("GRPC_REFUSAL_COOLDOWN_SECS", "60"),
    ];
    vars.extend_from_slice(overrides);
    spawn(fake_stripe::Config::default(), &vars).await
}

/// A channel to `app` whose connection comes from `local` (any 127.0.0.0/8 address).
async fn channel_from(app: &TestApp, local: &str) -> Channel {
    Channel::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .local_address(Some(local.parse().unwrap()))
        .connect()
        .await
        .unwrap()
}

/// A channel from `local` whose connection opens with `header` (a PROXY protocol header).
async fn channel_with_header(
    app: &TestApp,
    local: &'static str,
    header: &'static [u8],
) -> Result<Channel, tonic::transport::Error> {
    let addr = app.addr;
    tonic::transport::Endpoint::from_static("http://proxied.invalid")
        .connect_with_connector(tower::service_fn(move |_| async move {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(std::net::SocketAddr::new(local.parse().unwrap(), 0))?;
            let mut tcp = socket.connect(addr).await?;
            tcp.write_all(header).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
        }))
        .await
}

fn create(token: &str) -> tonic::Request<proto::v1::CreateRideRequest> {
    authed(token, Some(&new_key()), ride_request())
}

fn forwarded_for(
    mut request: tonic::Request<proto::v1::CreateRideRequest>,
    client: &str,
) -> tonic::Request<proto::v1::CreateRideRequest> {
    request
        .metadata_mut()
        .insert("x-forwarded-for", client.parse().unwrap());
    request
}

fn ok(result: Result<Response<CreateRideResponse>, Status>) -> CreateRideResponse {
    match result {
        Ok(response) => response.into_inner(),
        Err(status) => panic!("refused: {status:?}"),
    }
}

/// The ride audit records' client addresses, in insertion order.
async fn origin_ips(app: &TestApp) -> Vec<IpAddr> {
    app.audit_records()
        .await
        .iter()
        .map(|record| record.origin_ip.addr())
        .collect()
}

/// A connection holding the users table locked until it sends COMMIT: every token lookup waits.
async fn lock_users(app: &TestApp) -> diesel_async::AsyncPgConnection {
    app.db.lock_table("users").await
}

/// Waits until `n` sessions of the test's database wait on a lock.
async fn wait_for_lock_waiters(app: &TestApp, n: i64) {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = diesel_async::AsyncPgConnection::establish(app.db.url())
        .await
        .unwrap();
    for _ in 0..500 {
        let waiting: Count = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .get_result(&mut conn)
        .await
        .unwrap();
        if waiting.n >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no lookup came to wait on the lock");
}
