//! Per-user limits and cheap credential checks (`api_server::limits`), over real gRPC against a
//! real database: what is refused, with which status, and that a refusal writes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use api_server::{
    auth,
    grpc::{ON_BEHALF_OF_HEADER, reason},
    testing::*,
};
use diesel_async::RunQueryDsl;
use proto::v1::GetRideRequest;
use schema::{models::NewUser, schema::users};
use tonic::{Code, Status};
use tonic_types::StatusExt;

/// The RetryInfo delay of a refusal.
fn retry_delay(status: &Status) -> Duration {
    status
        .get_error_details()
        .retry_info()
        .and_then(|info| info.retry_delay)
        .unwrap_or_else(|| panic!("no RetryInfo in {status:?}"))
}

fn well_shaped_unknown_token() -> String {
    // A token of ours in shape, which no user has.
    auth::generate_token()
}

/// A CreateRide of `token`'s user with a new key, once it is at the provider, where it stays for
/// the fake provider's latency (the test's first provider call).
async fn held_at_the_provider(
    app: &TestApp,
    token: &str,
) -> tokio::task::JoinHandle<Result<tonic::Response<proto::v1::CreateRideResponse>, Status>> {
    let mut client = app.client().await;
    let request = authed(token, Some(&new_key()), ride_request());
    let call = tokio::spawn(async move { client.create_ride(request).await });
    while app.stripe.create_calls() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    call
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_create_bucket_refuses_with_retry_info_and_writes_nothing() {
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[
            ("RATE_LIMIT_CREATE_BURST", "2"),
            ("RATE_LIMIT_CREATE_PER_SEC", "0.001"),
        ],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let first = new_key();
    app.create_ride(&user, &first, ride_request())
        .await
        .unwrap();
    app.create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap();

    let refused_key = new_key();
    let status = app
        .create_ride(&user, &refused_key, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
    let delay = retry_delay(&status);
    // One token refills in 1,000 s at 0.001/s.
    assert!(
        delay > Duration::from_secs(900) && delay <= Duration::from_secs(1000),
        "{delay:?}"
    );
    assert!(app.key_row(&user, &refused_key).await.is_none());
    assert_eq!(app.rides().await.len(), 2);
    assert_eq!(app.stripe.create_calls(), 2);
    // A replay counts against the bucket too: it is refused as well, and cheaply.
    let status = app
        .create_ride(&user, &first, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);

    // Another user has a bucket of their own.
    let other = app.create_user(GOOD_CARD).await;
    app.create_ride(&other, &new_key(), ride_request())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_get_bucket_refuses_get_ride() {
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[
            ("RATE_LIMIT_GET_BURST", "1"),
            ("RATE_LIMIT_GET_PER_SEC", "0.001"),
        ],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let ride = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let mut client = app.client().await;
    let get = || authed(&user.token, None, GetRideRequest { id: ride.id });
    client.get_ride(get()).await.unwrap();
    let status = client.get_ride(get()).await.unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
    assert!(retry_delay(&status) > Duration::from_secs(900));
}

#[tokio::test(flavor = "multi_thread")]
async fn one_users_concurrent_creates_are_capped() {
    let stripe = fake_stripe::Config {
        latency: Duration::from_secs(5),
        ..fake_stripe::Config::default()
    };
    let app = TestApp::spawn_with(
        stripe,
        &[
            ("MAX_CONCURRENT_CREATES_PER_USER", "1"),
            ("STRIPE_TIMEOUT_MS", "30000"),
        ],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let slow = held_at_the_provider(&app, &user.token).await;

    let refused_key = new_key();
    let status = app
        .create_ride(&user, &refused_key, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
    assert!(retry_delay(&status) > Duration::ZERO);
    assert!(app.key_row(&user, &refused_key).await.is_none());
    // Another user is not held up.
    let other = app.create_user(GOOD_CARD).await;
    app.create_ride(&other, &new_key(), ride_request())
        .await
        .unwrap();

    // Once the first call is done, its place is free again.
    slow.await.unwrap().unwrap();
    app.create_ride(&user, &refused_key, ride_request())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_decline_budget_refuses_new_keys_but_replays_finished_ones() {
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[("DECLINE_BUDGET_PER_10_MIN", "2")],
    )
    .await;
    let tester = app.create_user(DECLINED_CARD).await;
    let first = new_key();
    for key in [first.clone(), new_key()] {
        let status = app
            .create_ride(&tester, &key, ride_request())
            .await
            .unwrap_err();
        assert_status(&status, Code::FailedPrecondition, reason::CARD_DECLINED);
    }
    let calls = app.stripe.create_calls();
    let keys = app.key_count().await;
    let audits = app.audit_records().await.len();

    let refused_key = new_key();
    let status = app
        .create_ride(&tester, &refused_key, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::ResourceExhausted, reason::RATE_LIMITED);
    let delay = retry_delay(&status);
    assert!(
        delay > Duration::from_secs(500) && delay <= Duration::from_secs(600),
        "{delay:?}"
    );
    assert!(app.key_row(&tester, &refused_key).await.is_none());
    assert_eq!(app.key_count().await, keys, "no key written");
    assert_eq!(app.audit_records().await.len(), audits, "no audit written");
    assert_eq!(app.stripe.create_calls(), calls, "no provider call");

    // A finished key still replays its answer.
    let status = app
        .create_ride(&tester, &first, ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::FailedPrecondition, reason::CARD_DECLINED);
    assert_eq!(header(status.metadata(), "idempotent-replayed"), "true");

    // The budget is the tester's own.
    let rider = app.create_user(GOOD_CARD).await;
    app.create_ride(&rider, &new_key(), ride_request())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_token_is_refused_without_the_database() {
    // No database behind this server: anything that needed one would answer UNAVAILABLE.
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[
            (
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:1/unreachable",
            ),
            ("DATABASE_POOL_TIMEOUT_MS", "300"),
        ],
    )
    .await;
    for token in [
        "rr_short",
        "not-ours-at-all",
        &format!("rr_{}=", "A".repeat(42)),
    ] {
        let user = TestUser {
            id: 0,
            token: token.to_owned(),
        };
        let status = app
            .create_ride(&user, &new_key(), ride_request())
            .await
            .unwrap_err();
        assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);
        let status = app
            .client()
            .await
            .get_ride(authed(token, None, GetRideRequest { id: 1 }))
            .await
            .unwrap_err();
        assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);
    }
    // A token of the right shape does need the database, which is down.
    let user = TestUser {
        id: 0,
        token: well_shaped_unknown_token(),
    };
    let status = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::Unavailable, reason::DATABASE_UNAVAILABLE);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_token_is_remembered_for_a_while_then_looked_up_again() {
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[("UNKNOWN_TOKEN_CACHE_TTL_MS", "1000")],
    )
    .await;
    let token = well_shaped_unknown_token();
    let user = TestUser {
        id: 0,
        token: token.clone(),
    };
    let status = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);

    // The token's user appears (as after a restore). The server answers from memory: had it
    // asked the database, the call would succeed.
    let digest = auth::token_digest(&token);
    let mut conn = app.pool.get().await.unwrap();
    diesel::insert_into(users::table)
        .values(NewUser {
            email: "late@example.com",
            stripe_customer_id: "cus_late",
            stripe_payment_method_id: GOOD_CARD,
            api_token_digest: &digest,
        })
        .execute(&mut conn)
        .await
        .unwrap();
    drop(conn);
    let status = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap_err();
    assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);
    assert_eq!(app.key_count().await, 0);

    // After the cache's TTL the token is looked up again and works.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    app.create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_internal_credential_cannot_read_rides() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let ride = app
        .create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let mut client = app.client().await;
    for on_behalf_of in [Some(user.id.to_string()), None] {
        let mut request = authed(INTERNAL_API_TOKEN, None, GetRideRequest { id: ride.id });
        if let Some(id) = &on_behalf_of {
            request
                .metadata_mut()
                .insert(ON_BEHALF_OF_HEADER, id.parse().unwrap());
        }
        let status = client.get_ride(request).await.unwrap_err();
        assert_status(
            &status,
            Code::PermissionDenied,
            reason::INTERNAL_CREDENTIAL_NOT_ALLOWED,
        );
    }
    // It still resumes a user's key on their behalf.
    let key = new_key();
    app.create_ride(&user, &key, ride_request()).await.unwrap();
    let mut request = authed(INTERNAL_API_TOKEN, Some(&key), ride_request());
    request
        .metadata_mut()
        .insert(ON_BEHALF_OF_HEADER, user.id.to_string().parse().unwrap());
    client.create_ride(request).await.unwrap();
}
