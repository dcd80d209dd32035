//! TLS and mutual TLS: a TLS client is answered and its address still seen, mutual TLS serves only
//! the client CA's certificates, reloads swap certificates without dropping connections (a failed
//! one keeps the old), and the health-check command probes a mutual TLS listener.

use std::time::Duration;

use api_server::{config::TlsConfig, testing::*, tls::TlsReloader};
use tonic_health::pb::health_check_response::ServingStatus;

use crate::{check, spawn};

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
