//! Cold tokens arriving together: a backend's burst is served in full, a full lookup queue refuses
//! with retry info and writes nothing, and concurrent calls with one cold token share one lookup.

use std::time::Duration;

use api_server::{grpc::reason, testing::*};
use diesel_async::RunQueryDsl;
use proto::v1::ride_service_client::RideServiceClient;
use tonic::Code;

use crate::{create, lock_users, ok, spawn, wait_for_lock_waiters};

#[tokio::test(flavor = "multi_thread")]
async fn a_cold_burst_from_one_backend_connection_is_served_in_full() {
    // One lookup place: every cold token queues for it, as a whole backend's riders do after a
    // restart. Concurrent calls with one token share a lookup.
    let stripe = fake_stripe::Config {
        latency: Duration::from_millis(50),
        ..fake_stripe::Config::default()
    };
    let app = spawn(stripe, &[("MAX_CONCURRENT_TOKEN_LOOKUPS", "1")]).await;
    let mut riders = Vec::new();
    for _ in 0..60 {
        riders.push(app.create_user(GOOD_CARD).await);
    }
    let backend = RideServiceClient::new(app.channel().await);
    let calls: Vec<_> = riders
        .iter()
        .flat_map(|rider| std::iter::repeat_n(rider.token.clone(), 3))
        .map(|token| {
            let mut backend = backend.clone();
            tokio::spawn(async move { backend.create_ride(create(&token)).await })
        })
        .collect();
    for call in calls {
        ok(call.await.unwrap());
    }
    assert_eq!(app.rides().await.len(), 180);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_lookup_queue_refuses_with_retry_info_and_writes_nothing() {
    let app = spawn(
        fake_stripe::Config::default(),
        &[
            ("MAX_CONCURRENT_TOKEN_LOOKUPS", "1"),
            ("TOKEN_LOOKUP_QUEUE_SIZE", "1"),
            ("TOKEN_LOOKUP_QUEUE_TIMEOUT_MS", "300"),
        ],
    )
    .await;
    let (first, second, third) = (
        app.create_user(GOOD_CARD).await,
        app.create_user(GOOD_CARD).await,
        app.create_user(GOOD_CARD).await,
    );
    // The users table locked: the first cold call's lookup holds the only place and waits.
    let mut locker = lock_users(&app).await;
    let client = RideServiceClient::new(app.channel().await);
    let held = {
        let mut client = client.clone();
        let token = first.token.clone();
        tokio::spawn(async move { client.create_ride(create(&token)).await })
    };
    wait_for_lock_waiters(&app, 1).await;
    // The second waits in the queue's one place, and is refused when its wait is over...
    let queued = {
        let mut client = client.clone();
        let token = second.token.clone();
        tokio::spawn(async move { client.create_ride(create(&token)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...while the third finds the queue full and is refused at once.
    let full = client
        .clone()
        .create_ride(create(&third.token))
        .await
        .unwrap_err();
    assert_status(&full, Code::ResourceExhausted, reason::RATE_LIMITED);
    let waited = queued.await.unwrap().unwrap_err();
    assert_status(&waited, Code::ResourceExhausted, reason::RATE_LIMITED);
    for status in [&full, &waited] {
        assert!(
            tonic_types::StatusExt::get_error_details(status)
                .retry_info()
                .is_some(),
            "no RetryInfo: {status:?}"
        );
    }
    assert_eq!(app.key_count().await, 0, "a refused call wrote a key");
    diesel::sql_query("COMMIT")
        .execute(&mut locker)
        .await
        .unwrap();
    ok(held.await.unwrap());
    // A busy queue is the server's state, not the peer's fault: the next call is served.
    ok(client.clone().create_ride(create(&second.token)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_calls_with_one_cold_token_share_one_lookup() {
    // One lookup place and no queue: only a shared lookup lets more than one cold call through.
    let app = spawn(
        fake_stripe::Config::default(),
        &[
            ("MAX_CONCURRENT_TOKEN_LOOKUPS", "1"),
            ("TOKEN_LOOKUP_QUEUE_SIZE", "0"),
        ],
    )
    .await;
    let (rider, other) = (
        app.create_user(GOOD_CARD).await,
        app.create_user(GOOD_CARD).await,
    );
    let mut locker = lock_users(&app).await;
    let client = RideServiceClient::new(app.channel().await);
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let mut client = client.clone();
            let token = rider.token.clone();
            tokio::spawn(async move { client.create_ride(create(&token)).await })
        })
        .collect();
    wait_for_lock_waiters(&app, 1).await;
    // Give the other four time to join the lookup in flight.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another cold token finds the one place taken and no queue: refused at once.
    let refused = client
        .clone()
        .create_ride(create(&other.token))
        .await
        .unwrap_err();
    assert_status(&refused, Code::ResourceExhausted, reason::RATE_LIMITED);
    diesel::sql_query("COMMIT")
        .execute(&mut locker)
        .await
        .unwrap();
    for call in calls {
        ok(call.await.unwrap());
    }
    assert_eq!(app.rides().await.len(), 5);
}
