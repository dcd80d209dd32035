//! The reaper: TTL on both sides, batches, unfinished keys recorded, rides kept.

use std::time::Duration;

use api_server::{
    rides::RideParams,
    testing::{GOOD_CARD, TestApp, new_key, ride_request},
};
use diesel::{QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use schema::{RecoveryPoint, models::KeyNeedingAttention, schema::keys_needing_attention};
use workers::{config::ReaperConfig, reaper::Reaper};

fn config(batch_size: i64) -> ReaperConfig {
    ReaperConfig {
        key_ttl: Duration::from_secs(72 * 3600),
        lock_rule: contract::key::LockRule::new(
            Duration::from_secs(90),
            Duration::from_secs(86_400),
        ),
        batch_size,
        interval: Duration::from_secs(1),
    }
}

async fn set_age(app: &TestApp, hours: i64) {
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(format!(
        "UPDATE idempotency_keys SET created_at = now() - interval '{hours} hours'"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn deletes_expired_keys_in_batches_and_keeps_rides() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    for _ in 0..5 {
        app.create_ride(&user, &new_key(), ride_request())
            .await
            .unwrap();
    }
    let reaper = Reaper::new(app.pool.clone(), config(2));

    set_age(&app, 71).await;
    let summary = reaper.run_once().await.unwrap();
    assert_eq!(summary.deleted, 0, "71 h is inside the TTL");
    assert_eq!(app.key_count().await, 5);

    set_age(&app, 73).await;
    let summary = reaper.run_once().await.unwrap();
    assert_eq!(summary.deleted, 5);
    assert_eq!(summary.batches, 3);
    assert_eq!(summary.unfinished_recorded, 0);
    assert_eq!(app.key_count().await, 0);
    let rides = app.rides().await;
    assert_eq!(rides.len(), 5, "rides outlive their keys");
    assert!(rides.iter().all(|ride| ride.idempotency_key_id.is_none()));
}

#[tokio::test(flavor = "multi_thread")]
async fn records_unfinished_keys_before_deleting_them() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let params = RideParams::new(Some(1.0), Some(2.0), Some(3.0), Some(4.0)).unwrap();
    // Claimed (so at `ride_created` with its ride), then abandoned.
    let lease = app.claim(&user, &key, &params).await;
    app.expire_lock(lease.key_id).await;
    app.create_ride(&user, &new_key(), ride_request())
        .await
        .unwrap();
    set_age(&app, 73).await;

    let summary = Reaper::new(app.pool.clone(), config(1000))
        .run_once()
        .await
        .unwrap();
    assert_eq!((summary.deleted, summary.unfinished_recorded), (2, 1));
    let mut conn = app.pool.get().await.unwrap();
    let attention: Vec<KeyNeedingAttention> = keys_needing_attention::table
        .select(KeyNeedingAttention::as_select())
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(attention.len(), 1);
    let item = &attention[0];
    assert_eq!(item.reason, "reaped_unfinished");
    assert_eq!(item.idempotency_key_id, lease.key_id);
    assert_eq!(item.idempotency_key, key);
    assert_eq!(item.user_id, user.id);
    assert_eq!(item.recovery_point, RecoveryPoint::RideCreated);
    assert_eq!(item.request_params, params.signature().params.to_value());
    assert!(item.resolved_at.is_none());
    assert_eq!(app.rides().await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn leaves_a_key_with_a_live_lock() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let params = RideParams::new(Some(1.0), Some(2.0), Some(3.0), Some(4.0)).unwrap();
    let _lease = app.claim(&user, &new_key(), &params).await;
    set_age(&app, 73).await;
    let summary = Reaper::new(app.pool.clone(), config(1000))
        .run_once()
        .await
        .unwrap();
    assert_eq!(summary.deleted, 0);
    assert_eq!(app.key_count().await, 1);
}
