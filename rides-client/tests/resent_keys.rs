//! Resent keys against the real api-server over loopback gRPC (`api_server::testing::TestApp`):
//! a call that resends its key (`resume_ride`; a retry, in `against_server.rs`) says so, the
//! server then looks the key up before it writes, and every answer is the one the call would have
//! had without it. What the server sent is read from its claim statement's counts
//! (`TestApp::claim_statements_sent`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use api_server::testing::{
    GOOD_CARD, INTERNAL_API_TOKEN, TestApp, TestUser, authed, replayed, ride_request,
};
use proto::v1::CreateRideRequest;
use rides_client::{Created, Credential, RidesClient, RidesError, new_key};

async fn client(app: &TestApp, user: &TestUser) -> RidesClient {
    RidesClient::new(app.channel().await, Credential::user(&user.token))
}

/// A user with one finished ride, made as a first send under a new key.
async fn user_with_a_ride(app: &TestApp) -> (TestUser, Created) {
    let user = app.create_user(GOOD_CARD).await;
    let first = client(app, &user)
        .await
        .create_ride_with_key(new_key(), ride_request())
        .await
        .unwrap();
    (user, first)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_key_is_read_before_any_write_and_answered_as_it_would_be_without() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let client = client(&app, &user).await;
    let key = new_key();
    let first = client
        .create_ride_with_key(key.clone(), ride_request())
        .await
        .unwrap();
    let before = app.claim_statements_sent();
    assert_eq!(before.reads, 0, "a first send writes at once: {before:?}");

    let replay = client
        .resume_ride(key.clone(), ride_request())
        .await
        .unwrap();
    assert!(replay.replayed && !first.replayed);
    assert_eq!(replay.ride, first.ride);
    let other = CreateRideRequest {
        target_lat: Some(40.0),
        ..ride_request()
    };
    let reused = client.resume_ride(key, other).await.unwrap_err();
    assert!(
        matches!(reused.error, RidesError::IdempotencyKeyReused(_)),
        "{reused:?}"
    );
    let after = app.claim_statements_sent();
    assert_eq!(after.reads, before.reads + 2, "{after:?}");
    assert_eq!(
        after.writes, before.writes,
        "no write for a key found: {after:?}"
    );

    // A key resent whose first send never arrived: not found, so written as a new key.
    let never_arrived = client.resume_ride(new_key(), ride_request()).await.unwrap();
    assert!(!never_arrived.replayed);
    let last = app.claim_statements_sent();
    assert_eq!(last.reads, after.reads + 1, "{last:?}");
    assert!(last.writes > after.writes, "{last:?}");
    assert_eq!(app.stripe.succeeded_charges(), 2);
    assert_eq!(app.key_count().await, 2);
}

/// A resent key that an attempt left unfinished and unlocked is found by the read, which decides
/// nothing (the key may need work): the attempt goes on from that read to the locking inspection,
/// with no claim statement of its own, and finishes the key with one charge.
#[tokio::test(flavor = "multi_thread")]
async fn a_resent_key_left_unfinished_is_read_then_claimed_and_charged_once() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.fail_at_the_provider(&user, &key).await;
    let before = app.claim_statements_sent();

    let resumed = client(&app, &user)
        .await
        .resume_ride(key.clone(), ride_request())
        .await
        .unwrap();
    assert!(!resumed.replayed, "the key was finished by this call");
    let after = app.claim_statements_sent();
    assert_eq!(after.reads, before.reads + 1, "{after:?}");
    assert_eq!(after.writes, before.writes, "{after:?}");
    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(app.rides().await.len(), 1);
    let replay = client(&app, &user)
        .await
        .resume_ride(key, ride_request())
        .await
        .unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.ride, resumed.ride);
}

/// The completer's call, on a user's behalf, never inserts a key: it reads first without the hint.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_on_a_users_behalf_reads_first_and_never_writes_a_key() {
    let app = TestApp::spawn().await;
    let (user, first) = user_with_a_ride(&app).await;
    let before = app.claim_statements_sent();
    let completer = client(&app, &user)
        .await
        .with_credential(Credential::internal(INTERNAL_API_TOKEN, user.id));

    let replay = completer
        .create_ride_with_key(first.key.clone(), ride_request())
        .await
        .unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.ride, first.ride);
    let after = app.claim_statements_sent();
    assert_eq!(after.reads, before.reads + 1, "{after:?}");
    assert_eq!(after.writes, before.writes, "{after:?}");
}

/// The hint is `true` or nothing: any other value is a first send, written at once, and answered
/// as it would be with the hint or without it.
#[tokio::test(flavor = "multi_thread")]
async fn a_resent_hint_other_than_true_counts_as_a_first_send() {
    let app = TestApp::spawn().await;
    let (user, first) = user_with_a_ride(&app).await;
    let mut grpc = app.client().await;
    for (hint, reads_first) in [("yes", false), ("TRUE", false), ("true", true)] {
        let before = app.claim_statements_sent();
        let mut request = authed(&user.token, Some(&first.key), ride_request());
        request.metadata_mut().insert(
            proto::metadata::IDEMPOTENCY_KEY_RESENT,
            hint.parse().unwrap(),
        );
        let replay = grpc.create_ride(request).await.unwrap();
        assert!(replayed(&replay), "{hint}");
        assert_eq!(replay.into_inner().ride, Some(first.ride.clone()), "{hint}");
        let after = app.claim_statements_sent();
        let read = u64::from(reads_first);
        assert_eq!(after.reads, before.reads + read, "{hint}: {after:?}");
        assert_eq!(after.writes, before.writes + 1 - read, "{hint}: {after:?}");
    }
    assert_eq!(app.stripe.succeeded_charges(), 1);
}
