//! gRPC clients over TLS and mutual TLS: `proto::client::endpoint` (the completer's, the load
//! generator's) against a real tonic server with rustls, serving the real `RideService` of a
//! TestApp, with certificates made by rcgen for each test.
//!
//! The server here is a plain `tonic::transport::Server` with `ServerTlsConfig`: the api-server's
//! own listener TLS (`GRPC_TLS_*`) is built on another branch; once merged, these tests should
//! spawn a TestApp with those settings instead.

use std::{net::SocketAddr, path::PathBuf};

use api_server::{
    grpc::RideApi,
    testing::{GOOD_CARD, TestApp, authed, new_key, ride_request},
};
use proto::{
    client::{ClientTls, endpoint},
    v1::{ride_service_client::RideServiceClient, ride_service_server::RideServiceServer},
};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use schema::RecoveryPoint;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::task::TaskTracker;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use workers::completer::Completer;

/// A CA and the server and client certificates it signed, as PEM files in a fresh directory.
struct Pki {
    dir: PathBuf,
    ca: PathBuf,
    server_cert: String,
    server_key: String,
    client: ClientTls,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("rides-tls-{name}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let leaf = |san: Option<SanType>| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.subject_alt_names.extend(san);
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &ca).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(Some(SanType::IpAddress([127, 0, 0, 1].into())));
        let (client_cert, client_key) = leaf(None);
        let write = |file: &str, contents: &str| {
            let path = dir.join(file);
            std::fs::write(&path, contents).unwrap();
            path
        };
        let client = ClientTls {
            ca: Some(write("ca.pem", &ca.pem())),
            cert: Some(write("client.pem", &client_cert)),
            key: Some(write("client.key", &client_key)),
        };
        Pki {
            ca: client.ca.clone().unwrap(),
            dir,
            server_cert,
            server_key,
            client,
        }
    }

    /// Trusts this CA but presents no certificate.
    fn anonymous(&self) -> ClientTls {
        ClientTls {
            ca: Some(self.ca.clone()),
            ..ClientTls::default()
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Serves `app`'s RideService over TLS with `pki`'s server certificate; with `mutual`, only to
/// clients whose certificate `pki`'s CA signed.
async fn serve_tls(app: &TestApp, pki: &Pki, mutual: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
        pki.server_cert.as_bytes(),
        pki.server_key.as_bytes(),
    ));
    if mutual {
        tls = tls.client_ca_root(Certificate::from_pem(std::fs::read(&pki.ca).unwrap()));
    }
    let service = RideServiceServer::new(RideApi::new(app.app.clone(), TaskTracker::new()));
    let server = Server::builder()
        .tls_config(tls)
        .unwrap()
        .add_service(service)
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);
    addr
}

/// One CreateRide through `endpoint(url, tls)`: whether it was answered OK.
async fn create_ride(app: &TestApp, url: &str, tls: &ClientTls) -> Result<(), String> {
    let user = app.create_user(GOOD_CARD).await;
    let channel = endpoint(url, tls)
        .map_err(|e| e.to_string())?
        .connect_lazy();
    RideServiceClient::new(channel)
        .create_ride(authed(&user.token, Some(&new_key()), ride_request()))
        .await
        .map(drop)
        .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_client_verifies_the_server() {
    let app = TestApp::spawn().await;
    let pki = Pki::new("server");
    let other = Pki::new("other");
    let addr = serve_tls(&app, &pki, false).await;
    let url = format!("https://{addr}");

    let wrong_ca = create_ride(&app, &url, &other.anonymous()).await;
    assert!(wrong_ca.is_err(), "a server signed by an untrusted CA");
    let plaintext = create_ride(&app, &format!("http://{addr}"), &ClientTls::default()).await;
    assert!(plaintext.is_err(), "plaintext to a TLS listener");
    app.assert_nothing_written().await;

    create_ride(&app, &url, &pki.anonymous()).await.unwrap();
    assert_eq!(app.rides().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn mutual_tls_admits_only_clients_signed_by_its_ca() {
    let app = TestApp::spawn().await;
    let pki = Pki::new("mutual");
    let other = Pki::new("intruder");
    let addr = serve_tls(&app, &pki, true).await;
    let url = format!("https://{addr}");

    let no_cert = create_ride(&app, &url, &pki.anonymous()).await;
    assert!(no_cert.is_err(), "a client without a certificate");
    let foreign_cert = ClientTls {
        ca: Some(pki.ca.clone()),
        ..other.client.clone()
    };
    let foreign = create_ride(&app, &url, &foreign_cert).await;
    assert!(foreign.is_err(), "a client certificate from another CA");
    let wrong_ca = create_ride(&app, &url, &other.client).await;
    assert!(wrong_ca.is_err(), "a client that trusts another CA");
    app.assert_nothing_written().await;

    create_ride(&app, &url, &pki.client).await.unwrap();
    assert_eq!(app.rides().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn completer_finishes_a_key_over_mutual_tls() {
    let app = TestApp::spawn().await;
    let pki = Pki::new("completer");
    let addr = serve_tls(&app, &pki, true).await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, _) = crate::completer::abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;

    let mut config = crate::completer::config(&app);
    config.api_server_url = format!("https://{addr}");
    config.api_server_tls = pki.client.clone();
    let summary = Completer::new(app.pool.clone(), config)
        .unwrap()
        .run_once()
        .await
        .unwrap();
    assert_eq!((summary.claimed, summary.completed), (1, 1));
    assert_eq!(
        app.key_row(&user, &key).await.unwrap().recovery_point,
        RecoveryPoint::Finished
    );
    assert_eq!(app.stripe.succeeded_charges(), 1);

    // Without its certificate the same completer is refused and finishes nothing.
    let mut config = crate::completer::config(&app);
    config.api_server_url = format!("https://{addr}");
    config.api_server_tls = pki.anonymous();
    let (key, _) = crate::completer::abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    let summary = Completer::new(app.pool.clone(), config)
        .unwrap()
        .run_once()
        .await
        .unwrap();
    assert_eq!(
        (summary.claimed, summary.completed, summary.still_failing),
        (1, 0, 1)
    );
    assert_ne!(
        app.key_row(&user, &key).await.unwrap().recovery_point,
        RecoveryPoint::Finished
    );
    assert_eq!(app.stripe.succeeded_charges(), 1);
}
