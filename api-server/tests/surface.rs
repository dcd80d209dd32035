//! The rest of the API surface: GetRide, health, reflection, the completer's internal credential,
//! the constraints the schema enforces, conflict retries, and the command line.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
};

use api_server::{
    grpc::{ON_BEHALF_OF_HEADER, reason},
    testing::*,
};
use diesel::{QueryableByName, result::DatabaseErrorKind, sql_types::Integer};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use proto::v1::GetRideRequest;
use schema::store::{ConflictRetry, StoreError, retry_transient};
use tokio::sync::Barrier;
use tonic::Code;

#[tokio::test(flavor = "multi_thread")]
async fn get_ride_returns_only_the_callers_own_rides() {
    let app = TestApp::spawn().await;
    let alice = app.create_user(GOOD_CARD).await;
    let bob = app.create_user(GOOD_CARD).await;
    let created = app
        .create_ride(&alice, &new_key(), ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let mut client = app.client().await;

    let fetched = client
        .get_ride(authed(
            &alice.token,
            None,
            GetRideRequest { id: created.id },
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fetched, created);

    for (user, id) in [
        (&bob, created.id),
        (&alice, created.id + 1000),
        (&alice, -1),
    ] {
        let status = client
            .get_ride(authed(&user.token, None, GetRideRequest { id }))
            .await
            .unwrap_err();
        assert_status(&status, Code::NotFound, reason::RIDE_NOT_FOUND);
    }
    let status = client
        .get_ride(tonic::Request::new(GetRideRequest { id: created.id }))
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, reason::MISSING_CREDENTIALS);
}

#[tokio::test(flavor = "multi_thread")]
async fn health_and_reflection_answer_without_proto_files() {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    use tonic_reflection::pb::v1alpha::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };

    let app = TestApp::spawn().await;
    let mut health = HealthClient::new(app.channel().await);
    for service in ["", "rides.v1.RideService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }

    let mut reflection = ServerReflectionClient::new(app.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer: {response:?}");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"rides.v1.RideService".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_owned()),
        "{names:?}"
    );
}

fn on_behalf_of<T>(token: &str, user_id: Option<i64>, key: &str, body: T) -> tonic::Request<T> {
    let mut request = authed(token, Some(key), body);
    if let Some(user_id) = user_id {
        request
            .metadata_mut()
            .insert(ON_BEHALF_OF_HEADER, user_id.to_string().parse().unwrap());
    }
    request
}

#[tokio::test(flavor = "multi_thread")]
async fn only_the_internal_credential_acts_on_behalf_of_a_user() {
    let app = TestApp::spawn().await;
    let rider = app.create_user(GOOD_CARD).await;
    let other = app.create_user(GOOD_CARD).await;
    let mut client = app.client().await;

    // A user's own token cannot borrow another user's identity.
    let status = client
        .create_ride(on_behalf_of(
            &other.token,
            Some(rider.id),
            &new_key(),
            ride_request(),
        ))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::PermissionDenied,
        reason::ON_BEHALF_OF_NOT_ALLOWED,
    );
    // A wrong internal token is just a wrong token.
    let almost = format!("{}x", &INTERNAL_API_TOKEN[..INTERNAL_API_TOKEN.len() - 1]);
    let status = client
        .create_ride(on_behalf_of(
            &almost,
            Some(rider.id),
            &new_key(),
            ride_request(),
        ))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::PermissionDenied,
        reason::ON_BEHALF_OF_NOT_ALLOWED,
    );
    // The internal token names no user by itself.
    let status = client
        .create_ride(on_behalf_of(
            INTERNAL_API_TOKEN,
            None,
            &new_key(),
            ride_request(),
        ))
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unauthenticated,
        reason::ON_BEHALF_OF_REQUIRED,
    );
    // An unknown user id.
    let status = client
        .create_ride(on_behalf_of(
            INTERNAL_API_TOKEN,
            Some(999_999),
            &new_key(),
            ride_request(),
        ))
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);
    assert_eq!(app.key_count().await, 0, "no rejected call wrote anything");

    // A key the rider never created: the internal credential creates no key and charges no
    // one, whatever user id it names.
    let key = new_key();
    let completer = |user_id: i64| {
        let mut client = client.clone();
        let key = key.clone();
        async move {
            client
                .create_ride(on_behalf_of(
                    INTERNAL_API_TOKEN,
                    Some(user_id),
                    &key,
                    ride_request(),
                ))
                .await
        }
    };
    let new_key_refused = |status: tonic::Status| {
        assert_status(
            &status,
            Code::PermissionDenied,
            reason::INTERNAL_CREDENTIAL_NOT_ALLOWED,
        );
    };
    new_key_refused(completer(rider.id).await.unwrap_err());
    assert_eq!(app.key_count().await, 0, "no rejected call wrote anything");

    // The completer's call on a key the rider created resumes it (here, replays it).
    let ride = app
        .create_ride(&rider, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let resumed = completer(rider.id).await.unwrap();
    assert!(replayed(&resumed));
    assert_eq!(resumed.into_inner().ride.unwrap(), ride);
    assert_eq!(app.key_row(&rider, &key).await.unwrap().user_id, rider.id);
    // The rider's key is not another user's.
    new_key_refused(completer(other.id).await.unwrap_err());
    assert_eq!(app.key_count().await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_schema_enforces_the_closed_set_of_recovery_points_and_key_invariants() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.create_ride(&user, &key, ride_request()).await.unwrap();
    let key_id = app.key_row(&user, &key).await.unwrap().id;
    let mut conn = app.db.connect().await;

    for statement in [
        "UPDATE idempotency_keys SET recovery_point = 'charged' WHERE id = $1",
        // Finished keys carry their outcome and no lock.
        "UPDATE idempotency_keys SET response_code = NULL WHERE id = $1",
        "UPDATE idempotency_keys SET locked_at = now(), lock_token = gen_random_uuid() WHERE id = $1",
        "UPDATE idempotency_keys SET recovery_point = 'started' WHERE id = $1",
        // A lock is a time and a token together.
        "UPDATE idempotency_keys SET recovery_point = 'started', response_code = NULL, response_body = NULL, locked_at = now() WHERE id = $1",
        // One ride per key.
        "INSERT INTO rides (idempotency_key_id, origin_lat, origin_lon, target_lat, target_lon, amount, currency, user_id) SELECT idempotency_key_id, 0, 0, 0, 0, 1, 'usd', user_id FROM rides WHERE idempotency_key_id = $1",
    ] {
        let error = diesel::sql_query(statement)
            .bind::<diesel::sql_types::BigInt, _>(key_id)
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert!(
            matches!(
                error,
                diesel::result::Error::DatabaseError(
                    DatabaseErrorKind::CheckViolation | DatabaseErrorKind::UniqueViolation,
                    _
                )
            ),
            "{statement}: {error:?}"
        );
    }
}

#[derive(QueryableByName)]
struct Counter {
    #[diesel(sql_type = Integer)]
    n: i32,
}

#[tokio::test(flavor = "multi_thread")]
async fn serialization_failures_are_retried_until_the_transaction_commits() {
    let app = TestApp::spawn().await;
    let mut setup = app.db.connect().await;
    for statement in [
        "CREATE TABLE counter (id int PRIMARY KEY, n int NOT NULL)",
        "INSERT INTO counter VALUES (1, 0)",
    ] {
        diesel::sql_query(statement)
            .execute(&mut setup)
            .await
            .unwrap();
    }
    let url = app.db.url().to_owned();
    let barrier = Arc::new(Barrier::new(2));
    let attempts = Arc::new(AtomicU32::new(0));

    // The first attempt reads, lets a competitor commit an update of the same row, then writes:
    // PostgreSQL refuses it with SQLSTATE 40001, and the retry runs the whole transaction again.
    let retried = {
        let (url, barrier, attempts) = (url.clone(), barrier.clone(), attempts.clone());
        tokio::spawn(async move {
            retry_transient(ConflictRetry::default(), || {
                let (url, barrier, attempts) = (url.clone(), barrier.clone(), attempts.clone());
                async move {
                    let attempt = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                    let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
                    conn.build_transaction()
                        .serializable()
                        .run(async |conn| {
                            let read: Counter =
                                diesel::sql_query("SELECT n FROM counter WHERE id = 1")
                                    .get_result(conn)
                                    .await?;
                            if attempt == 1 {
                                barrier.wait().await;
                                barrier.wait().await;
                            }
                            diesel::sql_query("UPDATE counter SET n = $1 WHERE id = 1")
                                .bind::<Integer, _>(read.n + 1)
                                .execute(conn)
                                .await?;
                            Ok::<_, StoreError>(())
                        })
                        .await
                }
            })
            .await
        })
    };
    barrier.wait().await;
    let mut competitor = AsyncPgConnection::establish(&url).await.unwrap();
    diesel::sql_query("UPDATE counter SET n = n + 1 WHERE id = 1")
        .execute(&mut competitor)
        .await
        .unwrap();
    barrier.wait().await;

    retried.await.unwrap().unwrap();
    assert_eq!(
        AtomicU32::load(&attempts, Ordering::SeqCst),
        2,
        "one conflict, one retry"
    );
    let counter: Counter = diesel::sql_query("SELECT n FROM counter WHERE id = 1")
        .get_result(&mut setup)
        .await
        .unwrap();
    assert_eq!(counter.n, 2, "both increments survived");
}

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

/// A CreateRideRequest padded with an unknown field, to exceed the message size limit.
#[derive(Clone, PartialEq, prost::Message)]
struct PaddedCreateRide {
    #[prost(double, optional, tag = "1")]
    origin_lat: Option<f64>,
    #[prost(double, optional, tag = "2")]
    origin_lon: Option<f64>,
    #[prost(double, optional, tag = "3")]
    target_lat: Option<f64>,
    #[prost(double, optional, tag = "4")]
    target_lon: Option<f64>,
    #[prost(bytes = "vec", tag = "100")]
    padding: Vec<u8>,
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_messages_and_metadata_are_refused_and_write_nothing() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let request = ride_request();

    let mut grpc = tonic::client::Grpc::new(app.channel().await);
    grpc.ready().await.unwrap();
    let padded = PaddedCreateRide {
        origin_lat: request.origin_lat,
        origin_lon: request.origin_lon,
        target_lat: request.target_lat,
        target_lon: request.target_lon,
        padding: vec![7; api_server::server::MAX_REQUEST_BYTES + 1],
    };
    let status = grpc
        .unary::<_, proto::v1::CreateRideResponse, _>(
            authed(&user.token, Some(&new_key()), padded),
            tonic::codegen::http::uri::PathAndQuery::from_static(
                "/rides.v1.RideService/CreateRide",
            ),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    // Metadata beyond the limit is refused by the HTTP/2 layer before the service runs.
    let mut bloated = authed(&user.token, Some(&new_key()), ride_request());
    bloated.metadata_mut().insert(
        "x-padding",
        "p".repeat(api_server::server::MAX_METADATA_BYTES as usize + 1)
            .parse()
            .unwrap(),
    );
    let result = app.client().await.create_ride(bloated).await;
    assert!(result.is_err(), "oversized metadata must be refused");

    assert_eq!(app.key_count().await, 0, "nothing was written");
    assert!(app.rides().await.is_empty());
    assert_eq!(app.stripe.create_calls(), 0);
    // The server is unharmed.
    app.create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap();
}
