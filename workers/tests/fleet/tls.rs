//! gRPC clients over TLS and mutual TLS: `proto::client::endpoint` (the completer's, the load
//! generator's) against the api-server's own TLS listener (`GRPC_TLS_*`), with certificates
//! made by the harness's throwaway CAs for each test.

use std::path::PathBuf;

use api_server::testing::{GOOD_CARD, TestApp, TestCa, TlsFiles, authed, new_key, ride_request};
use proto::{
    client::{ClientTls, endpoint},
    v1::ride_service_client::RideServiceClient,
};
use schema::RecoveryPoint;
use workers::completer::Completer;

/// The api-server behind TLS, and the PEM files a client needs to reach it.
struct Pki {
    app: TestApp,
    files: TlsFiles,
    ca: PathBuf,
    /// Trusts the server's CA and presents a certificate the server's client CA signed.
    client: ClientTls,
}

impl Pki {
    /// Spawns a TestApp whose listener speaks TLS with a certificate from `ca`; with `mutual`,
    /// it also requires client certificates signed by `ca`.
    async fn spawn(ca: &TestCa, mutual: bool) -> Pki {
        let files = TlsFiles::new(ca, mutual.then_some(ca));
        let env = files.env();
        let overrides: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let app = TestApp::spawn_with(fake_stripe::Config::default(), &overrides).await;
        let client = client_files(&files, "client", ca, Some(ca));
        Pki {
            app,
            ca: client.ca.clone().unwrap(),
            client,
            files,
        }
    }

    fn url(&self) -> String {
        format!("https://{}", self.app.addr)
    }

    /// Trusts the server's CA but presents no certificate.
    fn anonymous(&self) -> ClientTls {
        ClientTls {
            ca: Some(self.ca.clone()),
            ..ClientTls::default()
        }
    }
}

/// Writes a client's PEM files beside the server's: it trusts `trusts`, and presents a
/// certificate from `identity` if any.
fn client_files(
    files: &TlsFiles,
    name: &str,
    trusts: &TestCa,
    identity: Option<&TestCa>,
) -> ClientTls {
    let write = |file: String, contents: &str| {
        let path = files.dir.join(file);
        std::fs::write(&path, contents).unwrap();
        path
    };
    let ca = write(format!("{name}-trusts.pem"), &trusts.cert_pem);
    let (cert, key) = match identity {
        Some(issuer) => {
            let (cert, key) = issuer.issue(name);
            (
                Some(write(format!("{name}.pem"), &cert)),
                Some(write(format!("{name}.key"), &key)),
            )
        }
        None => (None, None),
    };
    ClientTls {
        ca: Some(ca),
        cert,
        key,
    }
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
    let ca = TestCa::new("server CA");
    let other = TestCa::new("other CA");
    let pki = Pki::spawn(&ca, false).await;
    let app = &pki.app;
    let url = pki.url();

    let untrusting = client_files(&pki.files, "untrusting", &other, None);
    let wrong_ca = create_ride(app, &url, &untrusting).await;
    assert!(wrong_ca.is_err(), "a server signed by an untrusted CA");
    let plaintext = create_ride(app, &format!("http://{}", app.addr), &ClientTls::default()).await;
    assert!(plaintext.is_err(), "plaintext to a TLS listener");
    app.assert_nothing_written().await;

    create_ride(app, &url, &pki.anonymous()).await.unwrap();
    assert_eq!(app.rides().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn mutual_tls_admits_only_clients_signed_by_its_ca() {
    let ca = TestCa::new("mutual CA");
    let intruder = TestCa::new("intruder CA");
    let pki = Pki::spawn(&ca, true).await;
    let app = &pki.app;
    let url = pki.url();

    let no_cert = create_ride(app, &url, &pki.anonymous()).await;
    assert!(no_cert.is_err(), "a client without a certificate");
    let foreign_cert = client_files(&pki.files, "foreign", &ca, Some(&intruder));
    let foreign = create_ride(app, &url, &foreign_cert).await;
    assert!(foreign.is_err(), "a client certificate from another CA");
    let wrong_trust = client_files(&pki.files, "misled", &intruder, Some(&ca));
    let wrong_ca = create_ride(app, &url, &wrong_trust).await;
    assert!(wrong_ca.is_err(), "a client that trusts another CA");
    app.assert_nothing_written().await;

    create_ride(app, &url, &pki.client).await.unwrap();
    assert_eq!(app.rides().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn completer_finishes_a_key_over_mutual_tls() {
    let ca = TestCa::new("completer CA");
    let pki = Pki::spawn(&ca, true).await;
    let app = &pki.app;
    let user = app.create_user(GOOD_CARD).await;
    let (key, _) = crate::completer::abandoned_key(app, &user, RecoveryPoint::RideCreated).await;

    let mut config = crate::completer::config(app);
    config.api_server_url = pki.url();
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
    let mut config = crate::completer::config(app);
    config.api_server_url = pki.url();
    config.api_server_tls = pki.anonymous();
    let (key, _) = crate::completer::abandoned_key(app, &user, RecoveryPoint::RideCreated).await;
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
