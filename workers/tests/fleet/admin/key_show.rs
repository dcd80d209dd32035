//! `workers admin keys show`: what it reports of a key at every state.

use api_server::testing::{DECLINED_CARD, GOOD_CARD, TestApp, TestUser, new_key, ride_request};
use contract::{Outcome, PAYMENT_ACCEPTED};
use schema::RecoveryPoint;
use tonic::Code;
use workers::admin::{
    AdminError,
    keys::{self, KeySelector},
};

use super::{abandoned_at, db_settings, key_at, record_attention, show, sql};

#[tokio::test(flavor = "multi_thread")]
async fn show_reports_a_key_at_every_state() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;

    assert_shows_a_started_key(&app, &user).await;
    assert_shows_an_abandoned_key(&app, &user).await;
    assert_shows_a_charged_unlocked_key(&app, &user).await;
    assert_shows_finished_keys(&app, &user).await;

    // A reaped key is still shown through its attention row; an unknown one is not found.
    sql(
        &app,
        "UPDATE keys_needing_attention SET idempotency_key_id = 999999",
    )
    .await;
    let reaped = show(&app, 999_999).await;
    assert!(reaped.key.is_none());
    assert_eq!(reaped.attention.len(), 1);
    assert_eq!(reaped.attention[0].key_recovery_point_now, None);
    assert!(matches!(
        keys::show(&app.pool, &db_settings(), &KeySelector::Id(123_456_789)).await,
        Err(AdminError::NotFound(_))
    ));
}

/// A key at `started`, locked by a live attempt: its lock and holder, no charge yet, the same by
/// user and key string, and neither the lock token nor the rider's address printed.
async fn assert_shows_a_started_key(app: &TestApp, user: &TestUser) {
    let (started_key, started) = key_at(app, user, RecoveryPoint::Started).await;
    let report = show(app, started.key_id).await;
    let key = report.key.as_ref().unwrap();
    assert_eq!(key.recovery_point, RecoveryPoint::Started);
    assert_eq!(key.idempotency_key, started_key);
    assert_eq!(key.user_id, user.id);
    assert_eq!(
        key.expires_at.unwrap(),
        key.created_at + chrono::Duration::hours(72)
    );
    assert_eq!((key.lock.state, key.lock.live), ("held", true));
    assert_eq!(
        key.lock.holder, "alive",
        "the claiming server's session stands"
    );
    assert!(key.stored_outcome.is_none());
    assert_eq!(
        key.provider_idempotency_key, None,
        "no ride, so no charge yet"
    );
    assert!(report.ride.is_none());
    // Neither the lock token nor the rider's address is ever printed, in either form.
    let json = serde_json::to_string(&report).unwrap();
    let text = report.render();
    for printed in [&json, &text] {
        assert!(!printed.contains(&started.token.to_string()), "{printed}");
        assert!(printed.contains("r***@example.com"), "{printed}");
        assert!(
            !printed.contains("rider-"),
            "the address is redacted: {printed}"
        );
    }
    assert!(text.contains("LIVE"), "{text}");
    assert!(text.contains("holder alive"), "{text}");
    // The same key by user and key string.
    let by_string = keys::show(
        &app.pool,
        &db_settings(),
        &KeySelector::UserKey {
            user_id: user.id,
            key: started_key.clone(),
        },
    )
    .await
    .unwrap();
    assert_eq!(by_string.key.unwrap().id, started.key_id);
}

/// A key at `ride_created`, abandoned (its lock expired) and handed to a human.
async fn assert_shows_an_abandoned_key(app: &TestApp, user: &TestUser) {
    let (abandoned_key, abandoned) = abandoned_at(app, user, RecoveryPoint::RideCreated).await;
    let attention_id = record_attention(app, user, &abandoned_key, abandoned).await;
    let report = show(app, abandoned).await;
    let key = report.key.as_ref().unwrap();
    assert_eq!(key.recovery_point, RecoveryPoint::RideCreated);
    assert_eq!((key.lock.state, key.lock.live), ("held", false));
    let ride = report.ride.as_ref().unwrap();
    assert_eq!(ride.charge_id, None);
    assert_eq!(ride.receipt.staged_jobs, 0);
    assert_eq!(report.attention.len(), 1);
    assert_eq!(report.attention[0].id, attention_id);
    assert_eq!(
        report.attention[0].key_recovery_point_now,
        Some(RecoveryPoint::RideCreated)
    );
    assert!(report.render().contains("expired"));
}

/// A key at `charge_created`, unlocked.
async fn assert_shows_a_charged_unlocked_key(app: &TestApp, user: &TestUser) {
    let (_, charged) = key_at(app, user, RecoveryPoint::ChargeCreated).await;
    api_server::idempotency::release(&app.pool, Default::default(), &charged)
        .await
        .unwrap();
    let report = show(app, charged.key_id).await;
    let key = report.key.as_ref().unwrap();
    assert_eq!(key.recovery_point, RecoveryPoint::ChargeCreated);
    assert_eq!((key.lock.state, key.lock.live), ("none", false));
    assert!(report.ride.as_ref().unwrap().charge_id.is_some());
}

/// Finished keys: a paid ride with its receipt staged, and a declined card.
async fn assert_shows_finished_keys(app: &TestApp, user: &TestUser) {
    let paid_key = new_key();
    let paid = app
        .create_ride(user, &paid_key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    let paid_id = app.key_row(user, &paid_key).await.unwrap().id;
    let report = show(app, paid_id).await;
    let stored = report.key.as_ref().unwrap().stored_outcome.clone().unwrap();
    assert_eq!(stored.response_code, 0);
    match stored.outcome.unwrap() {
        Outcome::RideCreated { ride, message } => {
            assert_eq!(ride.id, paid.id);
            assert_eq!(ride.charge_id.as_deref(), Some(paid.charge_id.as_str()));
            assert_eq!(message, PAYMENT_ACCEPTED);
        }
        other => panic!("unexpected outcome {other:?}"),
    }
    let ride = report.ride.unwrap();
    assert_eq!(ride.id, paid.id);
    assert_eq!(ride.receipt.staged_jobs, 1, "the receipt is staged");

    let decliner = app.create_user(DECLINED_CARD).await;
    let declined_key = new_key();
    app.create_ride(&decliner, &declined_key, ride_request())
        .await
        .unwrap_err();
    let declined_id = app.key_row(&decliner, &declined_key).await.unwrap().id;
    let stored = show(app, declined_id)
        .await
        .key
        .unwrap()
        .stored_outcome
        .unwrap();
    assert_eq!(stored.response_code, Code::FailedPrecondition as i32);
    assert!(matches!(stored.outcome, Some(Outcome::CardDeclined { .. })));
}
