//! The compiled `workers` binary end to end: it dry-runs by default and applies with `--yes`.

use std::process::Output;

use api_server::testing::{GOOD_CARD, TestApp, TestUser, assert_status, ride_request};
use schema::RecoveryPoint;
use tonic::Code;
use uuid::Uuid;

use crate::common::{self, TestBroker};

use super::abandoned_at;

/// Runs the compiled `workers` binary with the test's database and broker.
async fn workers_cli(app: &TestApp, broker: &TestBroker, args: &[&str]) -> Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_workers"));
    command
        .args(args)
        .env("DATABASE_URL", app.db.url())
        .env("AMQP_URL", common::amqp_url())
        .env("AMQP_TOPOLOGY_PREFIX", &broker.topology.exchange)
        .env("RUST_LOG", "info")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("IDEMPOTENCY_LOCK_TIMEOUT_SECS");
    tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8(output.stderr.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_binary_dry_runs_by_default_and_applies_with_yes() {
    let app = TestApp::spawn().await;
    let broker = TestBroker::new().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let id = key_id.to_string();
    let token = app.key_row(&user, &key).await.unwrap().lock_token.unwrap();

    assert_show_prints_the_key_but_never_the_token(&app, &broker, &id, &key, token).await;
    assert_unlock_dry_runs_applies_with_yes_and_refuses(&app, &broker, &user, &key, &id, token)
        .await;
    assert_finish_dry_runs_then_applies(&app, &broker, &user, &key, &id).await;

    // backlog reads the broker named by AMQP_TOPOLOGY_PREFIX.
    let backlog = workers_cli(&app, &broker, &["admin", "backlog", "--json"]).await;
    assert!(backlog.status.success(), "{}", stderr(&backlog));
    let json: serde_json::Value = serde_json::from_slice(&backlog.stdout).unwrap();
    assert_eq!(json["queues"][0]["queue"], broker.topology.receipts_queue);
    broker.cleanup().await;
}

/// `key show`, as text and as JSON: the key in full on stdout, never in the logs, and never
/// the lock token.
async fn assert_show_prints_the_key_but_never_the_token(
    app: &TestApp,
    broker: &TestBroker,
    id: &str,
    key: &str,
    token: Uuid,
) {
    // show, as text and as JSON; never the token.
    let shown = workers_cli(app, broker, &["admin", "key", "show", "--key-id", id]).await;
    assert!(shown.status.success(), "{}", stderr(&shown));
    assert!(
        stdout(&shown).contains("ride_created"),
        "{}",
        stdout(&shown)
    );
    assert!(
        stdout(&shown).contains(key),
        "operators see the key in full"
    );
    assert!(!stderr(&shown).contains(key), "but it is never logged");
    let shown = workers_cli(
        app,
        broker,
        &["admin", "--json", "key", "show", "--key-id", id],
    )
    .await;
    let json: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(json["key"]["lock"]["state"], "held");
    assert_eq!(json["key"]["lock"]["live"], false);
    assert!(!stdout(&shown).contains(&token.to_string()));
}

/// `key unlock`: a dry run by default that changes nothing, applied with `--yes`, and a refused
/// precondition that exits non-zero saying why, on stderr and in `--json`.
async fn assert_unlock_dry_runs_applies_with_yes_and_refuses(
    app: &TestApp,
    broker: &TestBroker,
    user: &TestUser,
    key: &str,
    id: &str,
    token: Uuid,
) {
    let dry = workers_cli(app, broker, &["admin", "key", "unlock", "--key-id", id]).await;
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert!(stdout(&dry).contains("DRY RUN"), "{}", stdout(&dry));
    assert!(stdout(&dry).contains("locked_at"), "{}", stdout(&dry));
    assert_eq!(
        app.key_row(user, key).await.unwrap().lock_token,
        Some(token),
        "the dry run changed nothing"
    );

    // --yes applies.
    let applied = workers_cli(
        app,
        broker,
        &["admin", "key", "unlock", "--key-id", id, "--yes", "--json"],
    )
    .await;
    assert!(applied.status.success(), "{}", stderr(&applied));
    let json: serde_json::Value = serde_json::from_slice(&applied.stdout).unwrap();
    assert_eq!(json["mode"], "apply");
    assert_eq!(json["changes"].as_array().unwrap().len(), 2);
    let row = app.key_row(user, key).await.unwrap();
    assert_eq!((row.locked_at, row.lock_token), (None, None));

    // A refused precondition exits non-zero and says why, on stderr and in --json.
    let refused = workers_cli(
        app,
        broker,
        &["admin", "key", "unlock", "--key-id", id, "--yes"],
    )
    .await;
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("not locked"),
        "{}",
        stderr(&refused)
    );
    let refused = workers_cli(
        app,
        broker,
        &["admin", "key", "unlock", "--key-id", id, "--yes", "--json"],
    )
    .await;
    assert!(!refused.status.success());
    let json: serde_json::Value = serde_json::from_slice(&refused.stdout).unwrap();
    assert_eq!(json["error"], "refused");
}

/// `key finish`, end to end: the dry run changes nothing, `--yes` applies, and a retry then
/// replays the outcome.
async fn assert_finish_dry_runs_then_applies(
    app: &TestApp,
    broker: &TestBroker,
    user: &TestUser,
    key: &str,
    id: &str,
) {
    let finish = [
        "admin",
        "key",
        "finish",
        "--key-id",
        id,
        "--outcome",
        "declined",
    ];
    let dry = workers_cli(app, broker, &finish).await;
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert_eq!(
        app.key_row(user, key).await.unwrap().recovery_point,
        RecoveryPoint::RideCreated
    );
    let applied = workers_cli(app, broker, &[&finish[..], &["--yes"]].concat()).await;
    assert!(applied.status.success(), "{}", stderr(&applied));
    assert!(stdout(&applied).contains("APPLIED"));
    let status = app
        .create_ride(user, key, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::FailedPrecondition, "CARD_DECLINED");
}
