//! The `fake-stripe` binary: startup banner, per-request logging without secrets, and a
//! clean exit on SIGTERM.
#![cfg(unix)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const API_KEY: &str = "sk_test_binarysecret9876";
const IDEMPOTENCY_KEY: &str = "ride-77-very-private-idempotency-key";
const PAYMENT_METHOD: &str = "pm_card_visa_private123";

#[tokio::test(flavor = "multi_thread")]
async fn binary_serves_logs_without_secrets_and_exits_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fake-stripe"))
        .args(["--listen", "127.0.0.1:0", "--latency-ms", "0"])
        .env("FAKE_STRIPE_API_KEY", API_KEY)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut banner = String::new();
    stdout.read_line(&mut banner).unwrap();
    let base_url = banner
        .trim()
        .strip_prefix("fake-stripe listening on ")
        .expect(&banner)
        .to_owned();
    assert!(base_url.starts_with("http://127.0.0.1:"), "{banner}");

    charge_twice_then_list_with_a_wrong_key(&base_url).await;

    let exit = terminate(&mut child).await;
    assert!(exit.success(), "{exit:?}");

    let mut logs = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut logs)
        .unwrap();
    let request_lines: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("/v1/payment_intents"))
        .collect();
    assert_eq!(request_lines.len(), 3, "one line per request:\n{logs}");
    assert!(
        request_lines[0].contains("status=200") && request_lines[0].contains("replayed=\"no\""),
        "{logs}"
    );
    assert!(request_lines[1].contains("replayed=\"yes\""), "{logs}");
    assert!(request_lines[2].contains("status=401"), "{logs}");
    for secret in [API_KEY, IDEMPOTENCY_KEY, PAYMENT_METHOD, "sk_test_wrong"] {
        assert!(!logs.contains(secret), "logs leak {secret}:\n{logs}");
    }
}

/// The same charge twice under one idempotency key (the second a replay), then a list with a
/// wrong API key (refused): the three requests the logs must show without their secrets.
async fn charge_twice_then_list_with_a_wrong_key(base_url: &str) {
    let client = reqwest::Client::new();
    let form = [
        ("amount", "1500"),
        ("currency", "usd"),
        ("payment_method", PAYMENT_METHOD),
        ("confirm", "true"),
    ];
    for expect_replay in [false, true] {
        let resp = client
            .post(format!("{base_url}/v1/payment_intents"))
            .bearer_auth(API_KEY)
            .header("Idempotency-Key", IDEMPOTENCY_KEY)
            .form(&form)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers().contains_key("idempotent-replayed"),
            expect_replay
        );
    }
    let resp = client
        .get(format!("{base_url}/v1/payment_intents"))
        .bearer_auth("sk_test_wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
}

/// Sends SIGTERM and waits up to 10 s for the process to exit.
async fn terminate(child: &mut std::process::Child) -> std::process::ExitStatus {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(exit) = child.try_wait().unwrap() {
            return exit;
        }
        assert!(
            Instant::now() < deadline,
            "fake-stripe did not exit on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
