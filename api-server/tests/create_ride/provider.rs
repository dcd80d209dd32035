//! The provider's failures: errors that leave the key resumable, an unexpected error, a lost
//! response, a charge older than the provider's idempotency window, and a timeout. In every case
//! a ride is charged once at most.

use std::time::Duration;

use api_server::{grpc::reason, testing::*};
use fake_stripe::FaultMode;
use schema::RecoveryPoint;
use tonic::Code;
use tonic_types::StatusExt;

#[tokio::test(flavor = "multi_thread")]
async fn provider_errors_leave_the_key_resumable_and_a_retry_charges_once() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::Error500, 1);

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();

    assert_status(
        &status,
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
    );
    assert!(status.get_error_details().retry_info().is_some());
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::RideCreated);
    assert!(
        key_row.locked_at.is_none(),
        "the key is unlocked for an immediate retry"
    );
    assert!(
        key_row.response_code.is_none(),
        "an unavailable provider is not a stored outcome"
    );

    let response = app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert!(!replayed(&response));
    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(app.rides().await.len(), 1);
    assert_eq!(app.staged_jobs().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unexpected_provider_error_is_internal_and_unlocks_the_key() {
    // The provider refuses our API key (HTTP 401): a misconfiguration, not a decline.
    let app = TestApp::spawn_with(
        fake_stripe::Config {
            api_key: Some("sk_test_somebody_else".into()),
            ..Default::default()
        },
        &[],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();

    assert_status(&status, Code::Internal, reason::INTERNAL);
    assert!(
        !status.message().contains("sk_test"),
        "no secret in the answer"
    );
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::RideCreated);
    assert!(key_row.locked_at.is_none() && key_row.lock_token.is_none());
    assert!(key_row.response_code.is_none());
    assert_eq!(app.stripe.succeeded_charges(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_charge_whose_response_was_lost_is_charged_once_in_total() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
    );
    assert_eq!(app.stripe.succeeded_charges(), 1, "the provider did charge");
    assert!(
        app.rides().await[0].stripe_charge_id.is_none(),
        "but we never heard"
    );

    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    assert_eq!(
        app.stripe.succeeded_charges(),
        1,
        "the retry reused the provider's key"
    );
    assert_eq!(app.stripe.payment_intents()[0].id, ride.charge_id);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unrecorded_charge_older_than_the_providers_key_window_is_found_not_repeated() {
    let app = TestApp::spawn_with_a_short_provider_key_window().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);
    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
    );
    assert_eq!(
        app.stripe.succeeded_charges(),
        1,
        "charged, but never recorded"
    );

    // Past the window the provider no longer remembers our key: a blind retry would charge again.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();

    assert_eq!(
        app.stripe.succeeded_charges(),
        1,
        "the earlier charge was found, not repeated"
    );
    assert_eq!(app.stripe.payment_intents()[0].id, ride.charge_id);
    assert_eq!(
        app.stripe.create_calls(),
        1,
        "no second charge was even attempted"
    );
    assert_eq!(app.staged_jobs().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ride_past_the_window_with_no_earlier_charge_is_charged_once() {
    let app = TestApp::spawn_with_a_short_provider_key_window().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    // The first attempt never reached the provider's charge logic.
    app.fail_at_the_provider(&user, &key).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();

    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(app.stripe.payment_intents()[0].id, ride.charge_id);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_provider_timeout_is_unavailable_and_the_retry_charges_once() {
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[("STRIPE_TIMEOUT_MS", "300")],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::Timeout, 1);

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
    );

    app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert_eq!(app.stripe.succeeded_charges(), 1);
}
