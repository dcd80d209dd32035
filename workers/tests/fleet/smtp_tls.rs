//! The receipt worker over SMTP with TLS against the mail sink's real TLS listeners (issue 33):
//! STARTTLS (`smtp://…?tls=required`) and TLS from the first byte (`smtps://`), each with
//! credentials, with certificates from a throwaway CA; a relay whose certificate another CA
//! signed is refused before anything, credentials included, is sent.

use std::path::PathBuf;

use api_server::testing::{TestApp, TestCa};
use mail_sink::{Login, MailSink, Retention, SinkTls};
use workers::mailer::receipt_message_id;

use crate::common::{self, TestBroker};

/// A mail sink with a certificate from `ca`, and the PEM file of the CA a worker trusts.
struct TlsSink {
    sink: MailSink,
    trusted_ca: PathBuf,
    dir: PathBuf,
}

impl TlsSink {
    async fn spawn(signed_by: &TestCa, trusted: &TestCa) -> TlsSink {
        let (cert, key) = signed_by.issue("mail-sink");
        let tls = SinkTls::from_pem(cert.as_bytes(), key.as_bytes()).unwrap();
        let sink = MailSink::spawn_with_tls(
            "127.0.0.1:0".parse().unwrap(),
            None,
            Retention::default(),
            Some(tls),
        )
        .await
        .unwrap();
        let dir = std::env::temp_dir().join(format!("rides-smtp-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let trusted_ca = dir.join("ca.pem");
        std::fs::write(&trusted_ca, &trusted.cert_pem).unwrap();
        TlsSink {
            sink,
            trusted_ca,
            dir,
        }
    }

    /// STARTTLS required, with credentials.
    fn starttls_url(&self) -> String {
        format!(
            "smtp://rides:s3cret@{}?tls=required&cacertfile={}",
            self.sink.addr(),
            self.trusted_ca.display()
        )
    }

    /// TLS from the first byte, with credentials.
    async fn smtps_url(&self) -> String {
        let url = self
            .sink
            .serve_smtps("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = url.trim_start_matches("smtps://");
        format!(
            "smtps://rides:s3cret@{addr}?cacertfile={}",
            self.trusted_ca.display()
        )
    }
}

impl Drop for TlsSink {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Mails one receipt through `smtp_url` and checks it arrived over TLS, once, and that the
/// credentials were sent over TLS only.
async fn mailed_over_tls(tls_sink: &TlsSink, smtp_url: &str) {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let ride_id = common::paid_ride(&app, &broker).await;
    let worker =
        common::receipt_worker_configured(&app.pool, &broker, &tls_sink.sink, None, |config| {
            config.smtp_url = workers::config::Secret::new(smtp_url);
        });
    let summary = worker.run_once(&broker.session.channel).await.unwrap();
    assert_eq!((summary.sent, summary.retried), (1, 0), "{summary:?}");
    let mails = tls_sink.sink.received();
    assert_eq!(mails.len(), 1);
    assert_eq!(mails[0].message_id(), Some(receipt_message_id(ride_id)));
    assert!(mails[0].over_tls, "the receipt crossed in the clear");
    assert_eq!(
        tls_sink.sink.logins(),
        [Login {
            user: "rides".to_owned(),
            over_tls: true
        }]
    );
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn receipts_are_mailed_over_starttls_with_credentials_only_inside_tls() {
    let ca = TestCa::new("smtp-ca");
    let tls_sink = TlsSink::spawn(&ca, &ca).await;
    mailed_over_tls(&tls_sink, &tls_sink.starttls_url()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn receipts_are_mailed_over_smtps() {
    let ca = TestCa::new("smtp-ca");
    let tls_sink = TlsSink::spawn(&ca, &ca).await;
    let url = tls_sink.smtps_url().await;
    mailed_over_tls(&tls_sink, &url).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_relay_signed_by_another_ca_is_refused_and_no_credential_is_sent() {
    let (theirs, ours) = (TestCa::new("impostor-ca"), TestCa::new("smtp-ca"));
    let tls_sink = TlsSink::spawn(&theirs, &ours).await;
    let smtps = tls_sink.smtps_url().await;
    for url in [tls_sink.starttls_url(), smtps] {
        let app = TestApp::spawn().await;
        let broker = TestBroker::with_delivery_limit(2).await;
        common::paid_ride(&app, &broker).await;
        let worker =
            common::receipt_worker_configured(&app.pool, &broker, &tls_sink.sink, None, |c| {
                c.smtp_url = workers::config::Secret::new(url.as_str());
            });
        let summary = worker.run_once(&broker.session.channel).await.unwrap();
        assert_eq!(summary.sent, 0, "{summary:?}");
        assert!(
            summary.retried >= 1,
            "a TLS failure is temporary: {summary:?}"
        );
        assert_eq!(
            broker
                .wait_for_depth(&broker.topology.dead_letter_queue, 1)
                .await,
            1,
            "bounded by the delivery limit"
        );
        broker.cleanup().await;
    }
    assert!(tls_sink.sink.received().is_empty());
    assert!(tls_sink.sink.logins().is_empty(), "credentials were sent");
}
