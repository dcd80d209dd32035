//! The transport limits: the advertised stream cap, message caps on the health and reflection
//! services, the preface deadline, the per-IP and total connection caps, idle and aged
//! connections, refused peers' cool-down and peers that never answer pings.

use std::time::Duration;

use api_server::testing::*;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tonic::{Code, transport::Channel};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::{check, spawn};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

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
