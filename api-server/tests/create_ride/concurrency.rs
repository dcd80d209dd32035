//! Many requests at once: identical requests make one ride and one charge, two users' equal keys
//! stay apart, distinct keys all succeed, and shutdown lets a request in flight finish.

use std::time::Duration;

use api_server::{grpc::reason, testing::*};
use proto::v1::CreateRideRequest;
use schema::RecoveryPoint;
use tonic::Code;

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_identical_requests_make_one_ride_and_one_charge() {
    let app = TestApp::spawn_with(
        fake_stripe::Config {
            latency: Duration::from_millis(50),
            ..Default::default()
        },
        &[],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let channel = app.channel().await;

    let attempts = (0..50).map(|_| {
        let mut client = proto::v1::ride_service_client::RideServiceClient::new(channel.clone());
        let request = authed(&user.token, Some(&key), ride_request());
        tokio::spawn(async move { client.create_ride(request).await })
    });
    let results = futures_util::future::join_all(attempts).await;

    let mut ride_ids = Vec::new();
    for result in results {
        match result.unwrap() {
            Ok(response) => ride_ids.push(response.into_inner().ride.unwrap().id),
            Err(status) => assert_status(&status, Code::Aborted, reason::IDEMPOTENCY_KEY_IN_USE),
        }
    }
    assert!(
        !ride_ids.is_empty(),
        "the attempt that held the key succeeded"
    );
    ride_ids.dedup();
    assert_eq!(ride_ids.len(), 1, "every success is the same ride");
    assert_eq!(app.rides().await.len(), 1);
    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(app.staged_jobs().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_users_may_use_the_same_key_independently() {
    let app = TestApp::spawn().await;
    let alice = app.create_user(GOOD_CARD).await;
    let bob = app.create_user(GOOD_CARD).await;
    let key = new_key();

    let for_alice = app.create_ride(&alice, &key, ride_request()).await.unwrap();
    let other_params = CreateRideRequest {
        origin_lat: Some(1.0),
        ..ride_request()
    };
    let for_bob = app.create_ride(&bob, &key, other_params).await.unwrap();

    assert!(
        !replayed(&for_alice) && !replayed(&for_bob),
        "bob never sees alice's outcome"
    );
    let (a, b) = (
        for_alice.into_inner().ride.unwrap(),
        for_bob.into_inner().ride.unwrap(),
    );
    assert_ne!(a.id, b.id);
    assert_eq!(b.origin_lat, 1.0);
    assert_eq!(app.stripe.succeeded_charges(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_concurrent_requests_with_distinct_keys_all_succeed() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let channel = app.channel().await;

    let attempts = (0..100).map(|_| {
        let mut client = proto::v1::ride_service_client::RideServiceClient::new(channel.clone());
        let request = authed(&user.token, Some(&new_key()), ride_request());
        tokio::spawn(async move { client.create_ride(request).await })
    });
    for result in futures_util::future::join_all(attempts).await {
        result
            .unwrap()
            .expect("no conflict is surfaced to a client");
    }
    assert_eq!(app.rides().await.len(), 100);
    assert_eq!(app.stripe.succeeded_charges(), 100);
    assert_eq!(app.staged_jobs().await.len(), 100);
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_lets_an_in_flight_request_finish() {
    let mut app = TestApp::spawn_with(
        fake_stripe::Config {
            latency: Duration::from_millis(400),
            ..Default::default()
        },
        &[],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let mut client = app.client().await;
    let request = authed(&user.token, Some(&key), ride_request());
    let in_flight = tokio::spawn(async move { client.create_ride(request).await });
    // Wait until the attempt is charging, then ask the server to stop.
    for _ in 0..100 {
        if app.stripe.create_calls() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    app.shutdown().await;

    in_flight
        .await
        .unwrap()
        .expect("the in-flight request completes");
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::Finished);
    assert!(key_row.locked_at.is_none());
}
