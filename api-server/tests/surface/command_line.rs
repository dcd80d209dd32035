//! The `api-server` command line: `migrate` creates and migrates a missing database, idempotently,
//! and `users create` prints a token that authenticates.

use std::process::Command;

use api_server::testing::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

fn api_server_command(database_url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_api-server"));
    command
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "warn");
    command
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_creates_and_migrates_a_missing_database_and_is_idempotent() {
    let admin = std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let name = format!("rides_cli_{}", uuid::Uuid::new_v4().simple());
    let url = schema::database_url(&admin, &name);

    let first = api_server_command(&url).arg("migrate").output().unwrap();
    let second = api_server_command(&url).arg("migrate").output().unwrap();

    let mut conn = AsyncPgConnection::establish(&admin).await.unwrap();
    diesel::sql_query(format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
        .execute(&mut conn)
        .await
        .unwrap();
    let first_out = String::from_utf8_lossy(&first.stdout);
    assert!(first.status.success(), "{first:?}");
    assert!(first_out.contains("created the database"), "{first_out}");
    assert!(first_out.contains("applied 20261121090000"), "{first_out}");
    assert!(second.status.success(), "{second:?}");
    assert_eq!(
        String::from_utf8_lossy(&second.stdout).trim(),
        "database is up to date"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn users_create_prints_a_token_that_authenticates() {
    let app = TestApp::spawn().await;
    let output = api_server_command(app.db.url())
        .args([
            "users",
            "create",
            "--email",
            "cli@example.com",
            "--stripe-customer-id",
            "cus_cli",
            "--stripe-payment-method-id",
            GOOD_CARD,
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let token = stdout.lines().last().unwrap().to_owned();
    assert!(token.starts_with("rr_"));
    assert!(
        !String::from_utf8_lossy(&output.stderr).contains(&token),
        "the token is not logged"
    );

    let user = TestUser { id: 0, token };
    let response = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap();
    assert_eq!(
        response.into_inner().message,
        "Payment accepted. Your pilot is on their way!"
    );

    // The same email again is refused, and says why.
    let again = api_server_command(app.db.url())
        .args([
            "users",
            "create",
            "--email",
            "cli@example.com",
            "--stripe-customer-id",
            "cus_cli2",
            "--stripe-payment-method-id",
            GOOD_CARD,
        ])
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
}
