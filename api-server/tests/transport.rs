//! The gRPC listener against real clients on loopback: TLS and mutual TLS with certificate
//! reloads, and the transport limits (HTTP/2 stream cap, message caps on every service, the
//! preface deadline, the idle timeout, the per-IP connection cap).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use api_server::{config::TlsConfig, testing::*, tls::TlsReloader};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tonic::{Code, transport::Channel};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

async fn spawn(overrides: &[(&str, String)]) -> TestApp {
    let overrides: Vec<(&str, &str)> = overrides
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    TestApp::spawn_with(fake_stripe::Config::default(), &overrides).await
}

async fn check(channel: Channel) -> Result<ServingStatus, tonic::Status> {
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await?;
    Ok(answer.into_inner().status())
}

/// Health over TLS with `tls`: the status, or why the connection or the call failed.
async fn check_over_tls(
    app: &TestApp,
    tls: tonic::transport::ClientTlsConfig,
) -> Result<ServingStatus, String> {
    let channel = app.tls_channel(tls).await.map_err(|e| format!("{e:?}"))?;
    check(channel).await.map_err(|e| format!("{e:?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tls_server_answers_a_tls_client_and_still_sees_its_address() {
    let ca = TestCa::new("server ca");
    let files = TlsFiles::new(&ca, None);
    let app = spawn(&files.env()).await;

    let channel = app.tls_channel(ca.client_tls()).await.unwrap();
    assert_eq!(
        check(channel.clone()).await.unwrap(),
        ServingStatus::Serving
    );

    // The audit record's address comes from the connection, through the TLS layer.
    let user = app.create_user(GOOD_CARD).await;
    proto::v1::ride_service_client::RideServiceClient::new(channel)
        .create_ride(authed(&user.token, Some(&new_key()), ride_request()))
        .await
        .unwrap();
    let audit = app.audit_records().await;
    assert_eq!(audit.len(), 1);
    assert_eq!(
        audit[0].origin_ip.addr(),
        std::net::IpAddr::from([127, 0, 0, 1])
    );

    // Plaintext HTTP/2 is not TLS: no answer.
    assert!(check(app.channel().await).await.is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn mutual_tls_serves_only_clients_with_a_certificate_from_the_client_ca() {
    let server_ca = TestCa::new("server ca");
    let client_ca = TestCa::new("client ca");
    let other_ca = TestCa::new("some other ca");
    let files = TlsFiles::new(&server_ca, Some(&client_ca));
    let app = spawn(&files.env()).await;

    let no_certificate = check_over_tls(&app, server_ca.client_tls()).await;
    assert!(
        no_certificate.is_err(),
        "served without a client certificate"
    );
    let wrong_ca = check_over_tls(
        &app,
        server_ca
            .client_tls()
            .identity(other_ca.client_identity("stranger")),
    )
    .await;
    assert!(wrong_ca.is_err(), "served a certificate from another CA");

    let good = check_over_tls(
        &app,
        server_ca
            .client_tls()
            .identity(client_ca.client_identity("completer")),
    )
    .await;
    assert_eq!(good, Ok(ServingStatus::Serving));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reload_swaps_the_certificate_without_dropping_open_connections() {
    let old_ca = TestCa::new("old ca");
    let new_ca = TestCa::new("new ca");
    let files = TlsFiles::new(&old_ca, None);
    let app = spawn(&files.env()).await;
    let open = app.tls_channel(old_ca.client_tls()).await.unwrap();
    assert_eq!(check(open.clone()).await.unwrap(), ServingStatus::Serving);

    files.replace_server_certificate(&new_ca);
    // The files are polled every second: wait (bounded) until new connections get the new one.
    let mut reloaded = false;
    for _ in 0..100 {
        if check_over_tls(&app, new_ca.client_tls()).await.is_ok() {
            reloaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(reloaded, "new connections never got the new certificate");
    assert!(
        check_over_tls(&app, old_ca.client_tls()).await.is_err(),
        "new connections still get the old certificate"
    );
    // The connection opened before the reload still answers. Had it been dropped, the channel
    // would have reconnected trusting only the old CA, and failed.
    assert_eq!(check(open).await.unwrap(), ServingStatus::Serving);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_reload_keeps_the_previous_certificates() {
    let ca = TestCa::new("ca");
    let files = TlsFiles::new(&ca, None);
    let reloader = TlsReloader::load(TlsConfig {
        cert_path: files.cert.clone(),
        key_path: files.key.clone(),
        client_ca_path: None,
        reload_interval: Duration::from_secs(1),
    })
    .unwrap();
    let before = reloader.current();
    std::fs::write(&files.cert, "-----BEGIN CERTIFICATE-----\nnot base64!\n").unwrap();
    assert!(reloader.reload().is_err());
    assert!(std::sync::Arc::ptr_eq(&before, &reloader.current()));

    files.replace_server_certificate(&ca);
    reloader.reload().unwrap();
    assert!(!std::sync::Arc::ptr_eq(&before, &reloader.current()));
}

#[tokio::test(flavor = "multi_thread")]
async fn settings_advertise_the_stream_cap() {
    let app = spawn(&[("GRPC_MAX_CONCURRENT_STREAMS", "7".to_owned())]).await;
    let tcp = TcpStream::connect(app.addr).await.unwrap();
    let (client, mut connection) = h2::client::handshake(tcp).await.unwrap();
    let mut ping_pong = connection.ping_pong().unwrap();
    tokio::spawn(connection);
    // The server's SETTINGS come before its answer to our PING.
    ping_pong.ping(h2::Ping::opaque()).await.unwrap();
    assert_eq!(client.current_max_send_streams(), 7);
}

#[tokio::test(flavor = "multi_thread")]
async fn health_and_reflection_refuse_messages_over_16_kib() {
    use tonic_reflection::pb::{v1, v1alpha};
    let app = spawn(&[]).await;
    // Under tonic's own 4 MiB default, which alone would let it through.
    let big = "x".repeat(4_000_000);

    let status = HealthClient::new(app.channel().await)
        .check(HealthCheckRequest {
            service: big.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    // Reflection answers a normal request, then ends the call with the same OUT_OF_RANGE when
    // the next one is too large (tonic-reflection alone would end it with OK).
    for size in [1 << 20, 4_000_000] {
        let big = "x".repeat(size);
        let request = |host: &str| v1::ServerReflectionRequest {
            host: host.to_owned(),
            message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let answers =
            v1::server_reflection_client::ServerReflectionClient::new(app.channel().await)
                .server_reflection_info(tokio_stream::iter([request(""), request(&big)]))
                .await;
        assert_only_the_first_answered(answers.map(|answers| answers.into_inner())).await;

        let request = |host: &str| v1alpha::ServerReflectionRequest {
            host: host.to_owned(),
            message_request: Some(
                v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
            ),
        };
        let answers =
            v1alpha::server_reflection_client::ServerReflectionClient::new(app.channel().await)
                .server_reflection_info(tokio_stream::iter([request(""), request(&big)]))
                .await;
        assert_only_the_first_answered(answers.map(|answers| answers.into_inner())).await;
    }

    // The server is still fine.
    assert_eq!(
        check(app.channel().await).await.unwrap(),
        ServingStatus::Serving
    );
}

/// The stream answers its first request and ends with OUT_OF_RANGE at the second.
async fn assert_only_the_first_answered<T: std::fmt::Debug>(
    answers: Result<tonic::Streaming<T>, tonic::Status>,
) {
    let mut answers = answers.unwrap();
    assert!(answers.message().await.unwrap().is_some());
    match answers.message().await {
        Err(status) => assert_eq!(status.code(), Code::OutOfRange, "{status:?}"),
        Ok(None) => panic!("the oversized call ended with OK"),
        Ok(Some(answer)) => panic!("a 4 MB request was answered: {answer:?}"),
    }
}

/// Reads until the server closes the connection (`None`) or sends something (`Some(bytes)`).
async fn next_from_server(tcp: &mut TcpStream) -> Option<usize> {
    let mut buffer = [0_u8; 1024];
    match tcp.read(&mut buffer).await {
        Ok(0) | Err(_) => None,
        Ok(n) => Some(n),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_sends_no_preface_is_closed() {
    let app = spawn(&[("GRPC_PREFACE_TIMEOUT_MS", "200".to_owned())]).await;
    let mut silent = TcpStream::connect(app.addr).await.unwrap();
    let mut half = TcpStream::connect(app.addr).await.unwrap();
    half.write_all(&PREFACE[..10]).await.unwrap();
    assert_eq!(next_from_server(&mut silent).await, None);
    assert_eq!(next_from_server(&mut half).await, None);
    // A real client is still served.
    assert_eq!(
        check(app.channel().await).await.unwrap(),
        ServingStatus::Serving
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_per_ip_cap_refuses_the_next_connection() {
    let app = spawn(&[("GRPC_MAX_CONNECTIONS_PER_IP", "2".to_owned())]).await;
    let mut admitted = Vec::new();
    for _ in 0..2 {
        let mut tcp = TcpStream::connect(app.addr).await.unwrap();
        tcp.write_all(PREFACE).await.unwrap();
        // The server's SETTINGS: admitted.
        assert!(next_from_server(&mut tcp).await.is_some());
        admitted.push(tcp);
    }
    let mut third = TcpStream::connect(app.addr).await.unwrap();
    let _ = third.write_all(PREFACE).await;
    assert_eq!(next_from_server(&mut third).await, None, "third admitted");

    // A closed connection gives its place back (once the server has noticed).
    drop(admitted.pop());
    let mut served = false;
    for _ in 0..100 {
        if let Ok(channel) = Channel::from_shared(format!("http://{}", app.addr))
            .unwrap()
            .connect()
            .await
            && check(channel).await.is_ok()
        {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served, "the freed place was never given back");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_connection_is_closed_though_it_answers_pings() {
    let app = spawn(&[
        ("GRPC_REQUEST_TIMEOUT_SECS", "3".to_owned()),
        ("GRPC_IDLE_TIMEOUT_MS", "3500".to_owned()),
        ("GRPC_KEEPALIVE_INTERVAL_SECS", "1".to_owned()),
    ])
    .await;
    let tcp = TcpStream::connect(app.addr).await.unwrap();
    // h2 answers the server's keepalive PINGs by itself; the client opens no stream.
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(60), connection).await;
    assert!(closed.is_ok(), "an idle connection was kept open");
    drop(client);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_old_connection_gets_goaway_at_its_age_and_is_closed_after_the_grace() {
    let app = spawn(&[
        ("GRPC_MAX_CONNECTION_AGE_SECS", "1".to_owned()),
        ("GRPC_MAX_CONNECTION_AGE_GRACE_SECS", "2".to_owned()),
    ])
    .await;
    let opened = std::time::Instant::now();
    let tcp = TcpStream::connect(app.addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    // A call that never finishes: its request body is never ended.
    let held = tonic::codegen::http::Request::post(format!(
        "http://{}/rides.v1.RideService/GetRide",
        app.addr
    ))
    .header("content-type", "application/grpc")
    .body(())
    .unwrap();
    let (_response, _body) = client.send_request(held, false).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Past the age: the server has said GOAWAY, so no new stream may be opened...
    let late = tonic::codegen::http::Request::post(format!(
        "http://{}/grpc.health.v1.Health/Check",
        app.addr
    ))
    .body(())
    .unwrap();
    let refused = match client.clone().ready().await {
        Ok(mut ready) => ready.send_request(late, true).err(),
        Err(error) => Some(error),
    };
    assert!(
        refused.as_ref().is_some_and(h2::Error::is_go_away),
        "no GOAWAY after the connection's age: {refused:?}"
    );
    // ...and the held call keeps the connection only until the grace runs out.
    let closed = tokio::time::timeout(Duration::from_secs(10), connection).await;
    assert!(closed.is_ok(), "the connection outlived its age and grace");
    assert!(
        opened.elapsed() >= Duration::from_millis(2500),
        "closed after {:?}, before the grace was over",
        opened.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_whose_calls_keep_being_refused_is_shut_out_for_the_cool_down() {
    let app = spawn(&[
        // A budget of 4 refusals (4 s of a refill of 1 a second), then 2 s shut out.
        ("GRPC_REFUSALS_PER_IP_PER_SEC", "1".to_owned()),
        ("GRPC_REFUSAL_COOLDOWN_SECS", "2".to_owned()),
    ])
    .await;
    let from = |address: &'static str| {
        let endpoint = Channel::from_shared(format!("http://{}", app.addr))
            .unwrap()
            .local_address(Some(address.parse().unwrap()));
        async move { endpoint.connect().await }
    };
    let mut flooder =
        proto::v1::ride_service_client::RideServiceClient::new(from("127.0.0.3").await.unwrap());
    let bad = || authed("not-a-token", Some(&new_key()), ride_request());
    for _ in 0..4 {
        let refused = flooder.create_ride(bad()).await.unwrap_err();
        assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    }
    // The next refusal overdraws the budget: the connection is cut (the call that overdrew it
    // may be answered first or cut with it).
    let mut cut = None;
    for _ in 0..3 {
        let status = flooder.create_ride(bad()).await.unwrap_err();
        if status.code() != Code::Unauthenticated {
            cut = Some(status);
            break;
        }
    }
    let cut = cut.expect("the peer was never cut off");
    // A connection cut mid-call surfaces as a transport error (UNKNOWN, or UNAVAILABLE when the
    // client found it closed before sending).
    assert!(
        matches!(cut.code(), Code::Unavailable | Code::Unknown)
            && cut.message().contains("transport error"),
        "{cut:?}"
    );
    // New connections from that address are refused; another address is served.
    let refused = match from("127.0.0.3").await {
        Ok(channel) => check(channel).await.is_err(),
        Err(_) => true,
    };
    assert!(refused, "a shut-out peer was served");
    let other = check(from("127.0.0.4").await.unwrap()).await.unwrap();
    assert_eq!(other, ServingStatus::Serving);
    // After the cool-down it is served again.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let again = check(from("127.0.0.3").await.unwrap()).await.unwrap();
    assert_eq!(again, ServingStatus::Serving);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_total_cap_refuses_the_next_connection_from_any_address() {
    let app = spawn(&[("GRPC_MAX_CONNECTIONS", "2".to_owned())]).await;
    let connect_from = |address: &str| {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket
            .bind(std::net::SocketAddr::new(address.parse().unwrap(), 0))
            .unwrap();
        socket.connect(app.addr)
    };
    let mut admitted = Vec::new();
    for address in ["127.0.0.6", "127.0.0.7"] {
        let mut tcp = connect_from(address).await.unwrap();
        tcp.write_all(PREFACE).await.unwrap();
        assert!(
            next_from_server(&mut tcp).await.is_some(),
            "{address} refused"
        );
        admitted.push(tcp);
    }
    // A third address, under its own per-IP cap, but over the total.
    let mut third = connect_from("127.0.0.8").await.unwrap();
    let _ = third.write_all(PREFACE).await;
    assert_eq!(next_from_server(&mut third).await, None, "third admitted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_that_never_answers_pings_is_closed() {
    let app = spawn(&[
        ("GRPC_KEEPALIVE_INTERVAL_SECS", "1".to_owned()),
        ("GRPC_KEEPALIVE_TIMEOUT_SECS", "1".to_owned()),
    ])
    .await;
    let opened = std::time::Instant::now();
    let mut tcp = TcpStream::connect(app.addr).await.unwrap();
    // The preface and an empty SETTINGS frame, then silence: no SETTINGS ack, no PING answer.
    tcp.write_all(PREFACE).await.unwrap();
    tcp.write_all(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(15), async {
        while next_from_server(&mut tcp).await.is_some() {}
    })
    .await;
    assert!(closed.is_ok(), "a peer that never answers PINGs was kept");
    assert!(
        opened.elapsed() >= Duration::from_secs(1),
        "closed after {:?}, before a PING could go unanswered",
        opened.elapsed()
    );
}

/// `api-server health-check` with the server's own TLS environment, as the kubelet's exec probe
/// runs it: its exit status and what it printed.
fn health_check_command(
    files: &TlsFiles,
    addr: std::net::SocketAddr,
    args: &[&str],
) -> (bool, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_api-server"))
        .arg("health-check")
        .args(args)
        .env_clear()
        .envs(files.env())
        .env("GRPC_LISTEN_ADDR", addr.to_string())
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_health_check_command_probes_a_mutual_tls_listener_with_its_own_certificate() {
    let ca = TestCa::new("cluster ca");
    let files = TlsFiles::new(&ca, Some(&ca));
    let app = spawn(&files.env()).await;
    for service in ["liveness", "rides.v1.RideService"] {
        let (ok, stderr) = health_check_command(&files, app.addr, &["--service", service]);
        assert!(ok, "{service}: {stderr}");
    }

    let (ok, stderr) = health_check_command(&files, app.addr, &["--service", "no.such.Service"]);
    assert!(!ok, "an unknown service passed the probe");
    assert!(stderr.contains("health check failed"), "{stderr}");

    let impostor = TestCa::new("impostor ca");
    let impostor_pem = files.dir.join("impostor.pem");
    std::fs::write(&impostor_pem, &impostor.cert_pem).unwrap();
    let (ok, _) = health_check_command(
        &files,
        app.addr,
        &[
            "--service",
            "liveness",
            "--ca",
            impostor_pem.to_str().unwrap(),
        ],
    );
    assert!(!ok, "a server the CA did not sign passed the probe");

    // Nothing listening: fails, within the probe's budget rather than the TCP timeout.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (ok, stderr) = health_check_command(&files, closed, &["--service", "liveness"]);
    assert!(!ok, "{stderr}");
}
