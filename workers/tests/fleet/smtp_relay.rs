//! The receipt mailer against a real MTA, Debian's Postfix, over TLS: STARTTLS required
//! (`smtp://…?tls=required`) and TLS from the first byte (`smtps://`), each with the relay's
//! certificate checked against a private CA (`cacertfile=`). A CA that did not sign the relay's
//! certificate is refused, and so is plaintext on the port that requires STARTTLS (the relay's
//! `530 Must issue a STARTTLS command first`). Ignored by default: `deploy/local/smtp-relay-tls.sh`
//! sets up the relay (installing `postfix` when absent), runs it with `--ignored`, and then checks
//! that both receipts reached the relay's mailbox over TLS.
//!
//! Reads SMTP_RELAY_STARTTLS_URL, SMTP_RELAY_SMTPS_URL, SMTP_RELAY_PLAIN_URL (the STARTTLS port
//! without TLS), SMTP_RELAY_OTHER_CA (a CA file that did not sign the relay's certificate) and
//! SMTP_RELAY_RCPT.

use std::time::Duration;

use chrono::Utc;
use workers::mailer::{MailError, Mailer, Receipt};

fn var(name: &str) -> String {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is not set: run deploy/local/smtp-relay-tls.sh"))
}

fn receipt(ride_id: i64) -> Receipt {
    Receipt {
        ride_id,
        to: var("SMTP_RELAY_RCPT"),
        amount: 2000,
        currency: "usd".into(),
        charge_id: format!("pi_relay_{ride_id}"),
        ride_created_at: Utc::now(),
    }
}

fn mailer(url: &str) -> Mailer {
    Mailer::new(
        url,
        "Rocket Rides <receipts@rocketrides.test>",
        Duration::from_secs(10),
    )
    .unwrap()
}

/// The URL with its `cacertfile=` pointing at another CA.
fn with_other_ca(url: &str) -> String {
    let (base, _) = url
        .split_once("cacertfile=")
        .expect("the URL names a cacertfile");
    format!("{base}cacertfile={}", var("SMTP_RELAY_OTHER_CA"))
}

#[tokio::test]
#[ignore = "needs the Postfix relay of deploy/local/smtp-relay-tls.sh"]
async fn receipts_reach_a_real_relay_over_starttls_and_implicit_tls() {
    // Ride ids 1 and 2: the script looks for their Message-IDs in the relay's mailbox.
    for (ride_id, url) in [
        (1, var("SMTP_RELAY_STARTTLS_URL")),
        (2, var("SMTP_RELAY_SMTPS_URL")),
    ] {
        mailer(&url)
            .send(&receipt(ride_id))
            .await
            .unwrap_or_else(|error| panic!("ride {ride_id} over {url}: {error}"));
    }
}

#[tokio::test]
#[ignore = "needs the Postfix relay of deploy/local/smtp-relay-tls.sh"]
async fn a_relay_certificate_from_another_ca_is_refused() {
    for url in [var("SMTP_RELAY_STARTTLS_URL"), var("SMTP_RELAY_SMTPS_URL")] {
        let url = with_other_ca(&url);
        let error = mailer(&url).send(&receipt(3)).await.unwrap_err();
        // A failed handshake is a connection failure: retried later, never a sent mail.
        assert!(matches!(error, MailError::Temporary(_)), "{url}: {error:?}");
    }
}

#[tokio::test]
#[ignore = "needs the Postfix relay of deploy/local/smtp-relay-tls.sh"]
async fn the_relay_refuses_mail_without_starttls() {
    let error = mailer(&var("SMTP_RELAY_PLAIN_URL"))
        .send(&receipt(4))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, MailError::Permanent(message) if message.contains("STARTTLS")),
        "{error:?}"
    );
}
