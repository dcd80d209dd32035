//! A duplicate CreateRide that finds its key's first attempt in flight waits for that attempt's
//! answer (issue 31): over real gRPC on loopback, real PostgreSQL, fake-stripe with latency, and
//! for the cross-process cases a second api-server, the real binary, on the same database.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{process::Command, time::Duration};

use api_server::grpc::{IDEMPOTENCY_WAIT_HEADER, reason};
use api_server::testing::*;
use common::*;
use prost::Message;
use proto::v1::CreateRideResponse;
use schema::RecoveryPoint;
use tonic::{Code, Request, Response};

/// A server with a slow provider, a user with `card`, and a new key whose first attempt is at
/// the provider.
async fn key_in_flight(card: &str) -> (TestApp, TestUser, String, FirstAttempt) {
    let app = app_with_a_slow_provider(&[]).await;
    let user = app.create_user(card).await;
    let key = new_key();
    let first = first_attempt_at_the_provider(&app, app.client().await, &user, &key).await;
    (app, user, key, first)
}

fn with_wait(
    mut request: Request<proto::v1::CreateRideRequest>,
    wait: &str,
) -> Request<proto::v1::CreateRideRequest> {
    request
        .metadata_mut()
        .insert(IDEMPOTENCY_WAIT_HEADER, wait.parse().unwrap());
    request
}

/// A successful duplicate's answer is the first one's, byte for byte, marked as a replay.
fn assert_same_ride(
    first: &Response<CreateRideResponse>,
    duplicate: &Response<CreateRideResponse>,
) {
    assert!(!replayed(first));
    assert!(replayed(duplicate), "the duplicate's answer is a replay");
    assert_eq!(
        first.get_ref().encode_to_vec(),
        duplicate.get_ref().encode_to_vec()
    );
    assert_eq!(
        header(first.metadata(), "idempotency-key-expires-at"),
        header(duplicate.metadata(), "idempotency-key-expires-at")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_while_the_first_is_at_the_provider_gets_its_ride_with_one_charge() {
    let (app, user, key, first) = key_in_flight(GOOD_CARD).await;

    let duplicate = app.create_ride(&user, &key, ride_request()).await.unwrap();

    let first = first.await.unwrap().unwrap();
    assert_same_ride(&first, &duplicate);
    assert_eq!(app.stripe.create_calls(), 1, "one provider call");
    assert_eq!(app.stripe.succeeded_charges(), 1, "one charge");
    assert_eq!(app.rides().await.len(), 1);
}

/// A duplicate that says it resends its key is decided in use by its claim's read alone, in the
/// request; the attempt that waits starts from that read, without a statement of its own.
#[tokio::test(flavor = "multi_thread")]
async fn a_resent_duplicate_is_found_in_use_by_its_read_and_waits_for_the_first() {
    let (app, user, key, first) = key_in_flight(GOOD_CARD).await;
    let before = app.claim_statements_sent();

    let mut request = authed(&user.token, Some(&key), ride_request());
    request.metadata_mut().insert(
        proto::metadata::IDEMPOTENCY_KEY_RESENT,
        "true".parse().unwrap(),
    );
    let duplicate = app.client().await.create_ride(request).await.unwrap();

    let first = first.await.unwrap().unwrap();
    assert_same_ride(&first, &duplicate);
    let after = app.claim_statements_sent();
    assert_eq!(after.reads, before.reads + 1, "one read: {after:?}");
    assert_eq!(after.writes, before.writes, "no write: {after:?}");
    assert_eq!(app.stripe.succeeded_charges(), 1, "one charge");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_while_the_first_is_at_the_provider_gets_its_decline() {
    let (app, user, key, first) = key_in_flight(DECLINED_CARD).await;

    let duplicate = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();

    let first = first.await.unwrap().unwrap_err();
    assert_status(&first, Code::FailedPrecondition, reason::CARD_DECLINED);
    assert_status(&duplicate, Code::FailedPrecondition, reason::CARD_DECLINED);
    assert_eq!(header(first.metadata(), "idempotent-replayed"), "false");
    assert_eq!(header(duplicate.metadata(), "idempotent-replayed"), "true");
    assert_eq!(first.message(), duplicate.message());
    assert_eq!(
        first.details(),
        duplicate.details(),
        "the same details, byte for byte"
    );
    assert_eq!(app.stripe.create_calls(), 1, "one provider call");
    assert_eq!(app.stripe.succeeded_charges(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_whose_deadline_is_shorter_than_the_provider_call_gets_in_use() {
    let (app, user, key, first) = key_in_flight(GOOD_CARD).await;

    let mut request = authed(&user.token, Some(&key), ride_request());
    request.set_timeout(Duration::from_millis(300));
    let duplicate = app.client().await.create_ride(request).await.unwrap_err();

    // Answered before its deadline, as before waiting existed: not cut off by it.
    assert_status(&duplicate, Code::Aborted, reason::IDEMPOTENCY_KEY_IN_USE);
    let first = first.await.unwrap().unwrap();
    assert!(!replayed(&first));
    assert_eq!(app.stripe.succeeded_charges(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_that_opts_out_gets_in_use_without_waiting() {
    // The key's holder never finishes (the test holds its lease), and the server would wait a
    // minute: only a call that does not wait is answered.
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[("IDEMPOTENCY_WAIT_MAX_MS", "60000")],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let params = api_server::rides::RideParams::try_from(ride_request()).unwrap();
    let lease = app.claim(&user, &key, &params).await;

    let request = with_wait(authed(&user.token, Some(&key), ride_request()), "0");
    let answered = tokio::time::timeout(
        Duration::from_secs(30),
        app.client().await.create_ride(request),
    )
    .await
    .expect("answered without waiting for the holder");

    assert_status(
        &answered.unwrap_err(),
        Code::Aborted,
        reason::IDEMPOTENCY_KEY_IN_USE,
    );
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(
        row.lock_token,
        Some(lease.token),
        "the holder keeps the key"
    );
    assert_eq!(app.stripe.create_calls(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_idempotency_wait_is_refused_and_writes_nothing() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    for bad in ["soon", "-1", "1.5", "123456789"] {
        let request = with_wait(authed(&user.token, Some(&new_key()), ride_request()), bad);
        let status = app.client().await.create_ride(request).await.unwrap_err();
        assert_status(
            &status,
            Code::InvalidArgument,
            reason::INVALID_IDEMPOTENCY_WAIT,
        );
    }
    // An invalid key is reported first, in the contract's order.
    let request = with_wait(authed(&user.token, Some("short"), ride_request()), "soon");
    let status = app.client().await.create_ride(request).await.unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        reason::INVALID_IDEMPOTENCY_KEY,
    );
    app.assert_nothing_written().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_on_another_api_server_gets_the_answer_by_polling_the_key() {
    let app = app_with_a_slow_provider(&[]).await;
    let (_other, client) = spawn_second_server(&app, &[]).await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    // The first attempt runs on the other api-server; the duplicate waits on this one.
    let first = first_attempt_at_the_provider(&app, client, &user, &key).await;

    let duplicate = app.create_ride(&user, &key, ride_request()).await.unwrap();

    let first = first.await.unwrap().unwrap();
    assert_same_ride(&first, &duplicate);
    assert_eq!(app.stripe.create_calls(), 1, "one provider call");
    assert_eq!(app.stripe.succeeded_charges(), 1, "one charge");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_claims_the_key_once_the_lock_of_a_paused_holder_expires() {
    const LOCK: &[(&str, &str)] = &[
        ("IDEMPOTENCY_LOCK_TIMEOUT_SECS", "3"),
        ("IDEMPOTENCY_WAIT_MAX_MS", "20000"),
    ];
    let app = app_with_a_slow_provider(LOCK).await;
    let (other, client) = spawn_second_server(&app, LOCK).await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let first = first_attempt_at_the_provider(&app, client, &user, &key).await;

    // The duplicate starts waiting while the holder runs; then the holder stops mid-charge for
    // good. Its liveness session stands (the kernel answers for its socket), so only the lock
    // timeout frees the key (a killed holder's key is taken over at once: tests/takeover.rs).
    let duplicate = {
        let mut client = app.client().await;
        let request = authed(&user.token, Some(&key), ride_request());
        tokio::spawn(async move { client.create_ride(request).await })
    };
    Command::new("kill")
        .args(["-STOP", &other.0.id().to_string()])
        .status()
        .unwrap();

    let duplicate = duplicate.await.unwrap().unwrap();
    // The waiter took the key over and finished it: the provider's idempotency made its charge
    // the one the paused holder had made.
    assert!(!replayed(&duplicate));
    let ride = duplicate.into_inner().ride.unwrap();
    assert_eq!(app.stripe.succeeded_charges(), 1, "one charge");
    assert_eq!(app.stripe.payment_intents()[0].id, ride.charge_id);
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    // The waiter's first claim was a first send (the write statement, which found the key in
    // use); its claim once the key was let go read first, as a key known to exist.
    let sent = app.claim_statements_sent();
    assert_eq!((sent.reads, sent.writes), (1, 1), "{sent:?}");
    drop(other);
    assert!(first.await.unwrap().is_err(), "the holder never answered");
}
