//! Admission as the service's real callers meet it (`api_server::admission`), over real gRPC
//! against a real database: a backend carrying many cold riders over one connection is served,
//! penalties fall only on failed authentication and never on a peer that presented a valid
//! credential, the internal credential is never shut out, and trusted proxies name their clients.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{net::IpAddr, time::Duration};

use api_server::{
    auth,
    grpc::{ON_BEHALF_OF_HEADER, reason},
    testing::*,
};
use diesel_async::{AsyncConnection, RunQueryDsl};
use proto::v1::{CreateRideResponse, ride_service_client::RideServiceClient};
use tokio::io::AsyncWriteExt;
use tonic::{Code, Response, Status, transport::Channel};

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

#[tokio::test(flavor = "multi_thread")]
async fn a_cold_burst_from_one_backend_connection_is_served_in_full() {
    // One lookup place: every cold token queues for it, as a whole backend's riders do after a
    // restart. Concurrent calls with one token share a lookup.
    let stripe = fake_stripe::Config {
        latency: Duration::from_millis(50),
        ..fake_stripe::Config::default()
    };
    let app = spawn(stripe, &[("MAX_CONCURRENT_TOKEN_LOOKUPS", "1")]).await;
    let mut riders = Vec::new();
    for _ in 0..60 {
        riders.push(app.create_user(GOOD_CARD).await);
    }
    let backend = RideServiceClient::new(app.channel().await);
    let calls: Vec<_> = riders
        .iter()
        .flat_map(|rider| std::iter::repeat_n(rider.token.clone(), 3))
        .map(|token| {
            let mut backend = backend.clone();
            tokio::spawn(async move { backend.create_ride(create(&token)).await })
        })
        .collect();
    for call in calls {
        ok(call.await.unwrap());
    }
    assert_eq!(app.rides().await.len(), 180);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_lookup_queue_refuses_with_retry_info_and_writes_nothing() {
    let app = spawn(
        fake_stripe::Config::default(),
        &[
            ("MAX_CONCURRENT_TOKEN_LOOKUPS", "1"),
            ("TOKEN_LOOKUP_QUEUE_SIZE", "1"),
            ("TOKEN_LOOKUP_QUEUE_TIMEOUT_MS", "300"),
        ],
    )
    .await;
    let (first, second, third) = (
        app.create_user(GOOD_CARD).await,
        app.create_user(GOOD_CARD).await,
        app.create_user(GOOD_CARD).await,
    );
    // The users table locked: the first cold call's lookup holds the only place and waits.
    let mut locker = lock_users(&app).await;
    let client = RideServiceClient::new(app.channel().await);
    let held = {
        let mut client = client.clone();
        let token = first.token.clone();
        tokio::spawn(async move { client.create_ride(create(&token)).await })
    };
    wait_for_lock_waiters(&app, 1).await;
    // The second waits in the queue's one place, and is refused when its wait is over...
    let queued = {
        let mut client = client.clone();
        let token = second.token.clone();
        tokio::spawn(async move { client.create_ride(create(&token)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...while the third finds the queue full and is refused at once.
    let full = client
        .clone()
        .create_ride(create(&third.token))
        .await
        .unwrap_err();
    assert_status(&full, Code::ResourceExhausted, reason::RATE_LIMITED);
    let waited = queued.await.unwrap().unwrap_err();
    assert_status(&waited, Code::ResourceExhausted, reason::RATE_LIMITED);
    for status in [&full, &waited] {
        assert!(
            tonic_types::StatusExt::get_error_details(status)
                .retry_info()
                .is_some(),
            "no RetryInfo: {status:?}"
        );
    }
    assert_eq!(app.key_count().await, 0, "a refused call wrote a key");
    diesel::sql_query("COMMIT")
        .execute(&mut locker)
        .await
        .unwrap();
    ok(held.await.unwrap());
    // A busy queue is the server's state, not the peer's fault: the next call is served.
    ok(client.clone().create_ride(create(&second.token)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_calls_with_one_cold_token_share_one_lookup() {
    // One lookup place and no queue: only a shared lookup lets more than one cold call through.
    let app = spawn(
        fake_stripe::Config::default(),
        &[
            ("MAX_CONCURRENT_TOKEN_LOOKUPS", "1"),
            ("TOKEN_LOOKUP_QUEUE_SIZE", "0"),
        ],
    )
    .await;
    let (rider, other) = (
        app.create_user(GOOD_CARD).await,
        app.create_user(GOOD_CARD).await,
    );
    let mut locker = lock_users(&app).await;
    let client = RideServiceClient::new(app.channel().await);
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let mut client = client.clone();
            let token = rider.token.clone();
            tokio::spawn(async move { client.create_ride(create(&token)).await })
        })
        .collect();
    wait_for_lock_waiters(&app, 1).await;
    // Give the other four time to join the lookup in flight.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another cold token finds the one place taken and no queue: refused at once.
    let refused = client
        .clone()
        .create_ride(create(&other.token))
        .await
        .unwrap_err();
    assert_status(&refused, Code::ResourceExhausted, reason::RATE_LIMITED);
    diesel::sql_query("COMMIT")
        .execute(&mut locker)
        .await
        .unwrap();
    for call in calls {
        ok(call.await.unwrap());
    }
    assert_eq!(app.rides().await.len(), 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_made_up_token_counts_against_its_address_even_when_its_caller_has_gone() {
    let app = spawn_with_a_budget_of_four(&[]).await;
    let rider = app.create_user(GOOD_CARD).await;
    let mut locker = lock_users(&app).await;
    let client = RideServiceClient::new(channel_from(&app, "127.0.0.28").await);
    // Six made-up tokens whose callers give up while their lookups wait on the lock.
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut request = create(&auth::generate_token());
                request.set_timeout(Duration::from_millis(300));
                client.create_ride(request).await
            })
        })
        .collect();
    for call in calls {
        let status = call.await.unwrap().unwrap_err();
        assert!(
            matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
            "{status:?}"
        );
    }
    diesel::sql_query("COMMIT")
        .execute(&mut locker)
        .await
        .unwrap();
    // The lookups end without their callers, find no user, and count against the address:
    // with a budget of four it is shut out, even for a valid token.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let channel = Channel::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .local_address(Some("127.0.0.28".parse().unwrap()))
        .connect_lazy();
    let served = RideServiceClient::new(channel)
        .create_ride(create(&rider.token))
        .await;
    assert!(
        served.is_err(),
        "the address escaped its failed authentications by hanging up"
    );
}

/// A connection holding the users table locked until it sends COMMIT: every token lookup waits.
async fn lock_users(app: &TestApp) -> diesel_async::AsyncPgConnection {
    let mut locker = diesel_async::AsyncPgConnection::establish(app.db.url())
        .await
        .unwrap();
    diesel::sql_query("BEGIN")
        .execute(&mut locker)
        .await
        .unwrap();
    diesel::sql_query("LOCK TABLE users IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .unwrap();
    locker
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

#[tokio::test(flavor = "multi_thread")]
async fn a_rate_limited_rider_does_not_shut_out_the_others_on_its_backend() {
    // A refusal budget of 4, and riders with a burst of 2 CreateRides.
    let app = spawn(
        fake_stripe::Config::default(),
        &[
            ("GRPC_REFUSALS_PER_IP_PER_SEC", "1"),
            ("RATE_LIMIT_CREATE_PER_SEC", "0.001"),
            ("RATE_LIMIT_CREATE_BURST", "2"),
        ],
    )
    .await;
    let (flooder, others) = (
        app.create_user(GOOD_CARD).await,
        app.create_user(GOOD_CARD).await,
    );
    let mut backend = RideServiceClient::new(channel_from(&app, "127.0.0.21").await);
    let mut limited = 0;
    for _ in 0..30 {
        match backend.create_ride(create(&flooder.token)).await {
            Ok(_) => {}
            Err(status) => {
                assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
                limited += 1;
            }
        }
    }
    assert_eq!(limited, 28);
    // The same connection serves the backend's other riders.
    ok(backend.create_ride(create(&others.token)).await);
    ok(backend.create_ride(create(&others.token)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_authentications_never_shut_out_a_peer_that_presented_a_valid_credential() {
    let app = spawn_with_a_budget_of_four(&[]).await;
    let rider = app.create_user(GOOD_CARD).await;
    let mut backend = RideServiceClient::new(channel_from(&app, "127.0.0.22").await);
    ok(backend.create_ride(create(&rider.token)).await);
    // Far past the budget of 4: a rider of this backend with a revoked or mistyped token.
    for _ in 0..40 {
        let status = backend
            .create_ride(create(&auth::generate_token()))
            .await
            .unwrap_err();
        assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);
    }
    ok(backend.create_ride(create(&rider.token)).await);
    // A new connection from the same address is accepted too.
    let mut again = RideServiceClient::new(channel_from(&app, "127.0.0.22").await);
    ok(again.create_ride(create(&rider.token)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_internal_credential_is_never_shut_out() {
    let app = spawn_with_a_budget_of_four(&[]).await;
    let rider = app.create_user(GOOD_CARD).await;
    let mut completer = RideServiceClient::new(channel_from(&app, "127.0.0.23").await);
    // The internal credential without on-behalf-of metadata: refused, and never counted.
    for _ in 0..20 {
        let status = completer
            .create_ride(authed(INTERNAL_API_TOKEN, Some(&new_key()), ride_request()))
            .await
            .unwrap_err();
        assert_status(
            &status,
            Code::Unauthenticated,
            reason::ON_BEHALF_OF_REQUIRED,
        );
    }
    // It resumes the rider's key.
    let key = new_key();
    ok(app.create_ride(&rider, &key, ride_request()).await);
    let mut request = authed(INTERNAL_API_TOKEN, Some(&key), ride_request());
    request
        .metadata_mut()
        .insert(ON_BEHALF_OF_HEADER, rider.id.to_string().parse().unwrap());
    ok(completer.create_ride(request).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trusted_http_proxy_names_its_clients_and_an_untrusted_peer_cannot() {
    let app = spawn_with_a_budget_of_four(&[("GRPC_TRUSTED_HTTP_PROXIES", "127.0.0.24/32")]).await;
    let rider = app.create_user(GOOD_CARD).await;
    let mut proxy = RideServiceClient::new(channel_from(&app, "127.0.0.24").await);
    // An attacker behind the proxy spends its budget and is shut out, by its own address...
    for _ in 0..5 {
        let _ = proxy
            .create_ride(forwarded_for(create("not-a-token"), "198.51.100.1"))
            .await;
    }
    let status = proxy
        .create_ride(forwarded_for(create(&rider.token), "198.51.100.1"))
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
    // ...while the proxy's connection serves everyone else, and records their own address. The
    // client's own claim left of the proxy's entry is not believed.
    ok(proxy
        .create_ride(forwarded_for(
            create(&rider.token),
            "203.0.113.9, 198.51.100.2",
        ))
        .await);
    assert_eq!(
        origin_ips(&app).await.last(),
        Some(&"198.51.100.2".parse::<IpAddr>().unwrap())
    );

    // An untrusted peer's x-forwarded-for is ignored: its refusals are its own.
    let mut untrusted = RideServiceClient::new(channel_from(&app, "127.0.0.25").await);
    let mut cut = false;
    for n in 0..10 {
        let forwarded = format!("198.51.100.{}", 100 + n);
        match untrusted
            .create_ride(forwarded_for(create("not-a-token"), &forwarded))
            .await
        {
            Err(status) if status.code() == Code::Unauthenticated => {}
            Err(_) => {
                cut = true;
                break;
            }
            Ok(_) => panic!("a bad token was served"),
        }
    }
    assert!(
        cut,
        "the untrusted peer spread its refusals over forged addresses"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_proxy_protocol_header_names_the_client_only_from_a_trusted_proxy() {
    let app = spawn(
        fake_stripe::Config::default(),
        &[("GRPC_TRUSTED_PROXIES", "127.0.0.26/32")],
    )
    .await;
    let rider = app.create_user(GOOD_CARD).await;
    let header = b"PROXY TCP4 198.51.100.7 127.0.0.1 40000 50051\r\n";
    let mut relayed = RideServiceClient::new(
        channel_with_header(&app, "127.0.0.26", header)
            .await
            .unwrap(),
    );
    // The client's own x-forwarded-for, relayed after the header, names nobody.
    ok(relayed
        .create_ride(forwarded_for(create(&rider.token), "203.0.113.9"))
        .await);
    let v2 =
        b"\r\n\r\n\0\r\nQUIT\n\x21\x11\x00\x0c\xc6\x33\x64\x08\x7f\x00\x00\x01\x9c\x40\xc3\x53";
    let mut relayed_v2 =
        RideServiceClient::new(channel_with_header(&app, "127.0.0.26", v2).await.unwrap());
    ok(relayed_v2.create_ride(create(&rider.token)).await);
    assert_eq!(
        origin_ips(&app).await,
        vec![
            "198.51.100.7".parse::<IpAddr>().unwrap(),
            "198.51.100.8".parse::<IpAddr>().unwrap()
        ]
    );
    // The same header from an untrusted peer is not a PROXY header but a broken preface.
    let served = match channel_with_header(&app, "127.0.0.27", header).await {
        Ok(channel) => RideServiceClient::new(channel)
            .create_ride(create(&rider.token))
            .await
            .is_ok(),
        Err(_) => false,
    };
    assert!(!served, "an untrusted peer's PROXY header was accepted");
    assert_eq!(origin_ips(&app).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_decline_budget_holds_across_replicas() {
    let app = spawn(
        fake_stripe::Config::default(),
        &[("DECLINE_BUDGET_PER_10_MIN", "2")],
    )
    .await;
    // A second api-server on the same database and provider, as behind a load balancer.
    let replica = api_server::App::from_config(&app.config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let replica_addr = listener.local_addr().unwrap();
    tokio::spawn(api_server::server::serve(
        listener,
        replica,
        std::future::pending(),
    ));
    let replica_channel = Channel::from_shared(format!("http://{replica_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let servers = [
        RideServiceClient::new(app.channel().await),
        RideServiceClient::new(replica_channel),
    ];
    let tester = app.create_user(DECLINED_CARD).await;
    // The tester alternates between the replicas; each new key is a fresh card test.
    let mut declined = 0;
    let mut refused_on = Vec::new();
    for attempt in 0..8 {
        let mut server = servers[attempt % 2].clone();
        let status = server.create_ride(create(&tester.token)).await.unwrap_err();
        match status.code() {
            Code::FailedPrecondition => {
                assert_status(&status, Code::FailedPrecondition, reason::CARD_DECLINED);
                declined += 1;
            }
            _ => {
                assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
                refused_on.push(attempt % 2);
            }
        }
    }
    // A per-process budget would allow 2 on each; counted from the database, each replica stops
    // at its first decline past the budget: budget + replicas - 1.
    assert_eq!(declined, 3, "declines charged across two replicas");
    assert_eq!(refused_on.len(), 5);
    assert!(refused_on.contains(&0) && refused_on.contains(&1));
}

#[tokio::test(flavor = "multi_thread")]
async fn services_with_client_certificates_get_fair_shares_of_createride_concurrency() {
    let server_ca = TestCa::new("server ca");
    let client_ca = TestCa::new("client ca");
    let files = TlsFiles::new(&server_ca, Some(&client_ca));
    let mut vars: Vec<(&str, String)> = files.env();
    vars.push(("SERVICE_SHARE_CREATES", "4".to_owned()));
    vars.push(("STRIPE_TIMEOUT_MS", "20000".to_owned()));
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let stripe = fake_stripe::Config {
        latency: Duration::from_secs(2),
        ..fake_stripe::Config::default()
    };
    let app = spawn(stripe, &vars).await;
    let service = |name: &str| {
        let tls = server_ca
            .client_tls()
            .identity(client_ca.client_identity(name));
        let app = &app;
        async move { RideServiceClient::new(app.tls_channel(tls).await.unwrap()) }
    };
    let (noisy, quiet) = (
        service("noisy-backend").await,
        service("quiet-backend").await,
    );
    let rider = app.create_user(GOOD_CARD).await;
    ok(noisy.clone().create_ride(create(&rider.token)).await);
    let at_provider = app.stripe.create_calls();

    // Alone, the noisy service may hold more than the whole budget of 4.
    let noisy_calls: Vec<_> = (0..6)
        .map(|_| {
            let mut noisy = noisy.clone();
            let token = rider.token.clone();
            tokio::spawn(async move { noisy.create_ride(create(&token)).await })
        })
        .collect();
    while app.stripe.create_calls() < at_provider + 6 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Another service is still served...
    let quiet_call = {
        let mut quiet = quiet.clone();
        let token = rider.token.clone();
        tokio::spawn(async move { quiet.create_ride(create(&token)).await })
    };
    while app.stripe.create_calls() < at_provider + 7 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and while it has a call in flight, the noisy one, over its share of 2, is refused.
    let status = noisy
        .clone()
        .create_ride(create(&rider.token))
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
    ok(quiet_call.await.unwrap());
    for call in noisy_calls {
        ok(call.await.unwrap());
    }
    // Alone again, it is served.
    ok(noisy.clone().create_ride(create(&rider.token)).await);
}
