//! `workers admin keys upgrade`: keys an older server left at `started` are retired, those at
//! `charge_created` finished.

use api_server::testing::{GOOD_CARD, TestApp, TestUser, replayed, ride_request};
use schema::RecoveryPoint;
use workers::admin::{Mode, keys};

use super::{abandoned_at, db_settings, key_at, stripe};

/// The upgrade step from an older server (one that committed the charge's record apart from
/// finishing the key): every key such a server left at `started` is retired (it held nothing, so a retry starts afresh and is charged
/// once), every key left at `charge_created` is finished as charged with its receipt staged (a
/// retry replays the ride, no second charge), a key whose lock is live is left and fails the
/// command until it expires, a dry run changes nothing, and this server's own keys are untouched.
#[tokio::test(flavor = "multi_thread")]
async fn upgrade_retires_started_keys_and_finishes_charge_created_ones() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (started_key, started) = abandoned_at(&app, &user, RecoveryPoint::Started).await;
    let (charged_key, charged) = abandoned_at(&app, &user, RecoveryPoint::ChargeCreated).await;
    let (live_key, live) = key_at(&app, &user, RecoveryPoint::ChargeCreated).await;
    let (current_key, _) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    assert_eq!(app.stripe.succeeded_charges(), 2);
    let upgrade = |mode| {
        let app = &app;
        async move {
            keys::upgrade(&app.pool, &db_settings(), &stripe(app), mode)
                .await
                .unwrap()
        }
    };

    let dry = upgrade(Mode::DryRun).await;
    assert_eq!(dry.keys.len(), 3, "{dry:?}");
    assert!(dry.failure().is_some(), "the live key is left");
    assert_eq!(app.key_count().await, 4, "a dry run deletes nothing");
    assert!(app.staged_jobs().await.is_empty(), "and stages nothing");

    let applied = upgrade(Mode::Apply).await;
    let actions = actions_of(&applied);
    assert_eq!(
        actions,
        [
            (started, "retired"),
            (charged, "finished"),
            (live.key_id, "left")
        ]
    );
    let failure = applied.failure().expect("a key was left");
    assert!(failure.contains("1 key(s) left"), "{failure}");
    assert!(applied.render().contains("LEFT"), "{}", applied.render());
    assert!(app.key_row(&user, &started_key).await.is_none());
    let row = app.key_row(&user, &charged_key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(row.locked_at, None);
    assert_eq!(
        app.staged_jobs().await.len(),
        1,
        "the finished key's receipt"
    );
    assert_eq!(
        app.key_row(&user, &current_key)
            .await
            .unwrap()
            .recovery_point,
        RecoveryPoint::RideCreated,
        "this server's own keys are not the step's"
    );

    // Once the live lock has expired, the step leaves nothing.
    app.expire_lock(live.key_id).await;
    let last = upgrade(Mode::Apply).await;
    assert_eq!(last.keys.len(), 1);
    assert!(last.failure().is_none());
    assert!(upgrade(Mode::Apply).await.keys.is_empty());

    assert_every_retry_answers(&app, &user, [&charged_key, &live_key], &started_key).await;
}

/// Each key the step went through, by id, with what it did to it: "retired", "finished", or
/// "left" (a key that may still be running).
fn actions_of(report: &keys::UpgradeReport) -> Vec<(i64, &'static str)> {
    report
        .keys
        .iter()
        .map(|key| {
            let action = match &key.outcome {
                keys::UpgradeOutcome::Retired { .. } => "retired",
                keys::UpgradeOutcome::Finished { .. } => "finished",
                keys::UpgradeOutcome::Left { reason } => {
                    assert!(reason.contains("may still be running"), "{reason}");
                    "left"
                }
            };
            (key.key_id, action)
        })
        .collect()
}

/// Every client retry now answers: the finished keys replay their ride, the retired key runs
/// afresh; the provider holds one charge per ride.
async fn assert_every_retry_answers(
    app: &TestApp,
    user: &TestUser,
    finished: [&String; 2],
    retired: &str,
) {
    for key in finished {
        let replay = app.create_ride(user, key, ride_request()).await.unwrap();
        assert!(replayed(&replay));
    }
    let fresh = app
        .create_ride(user, retired, ride_request())
        .await
        .unwrap();
    assert!(!replayed(&fresh));
    assert_eq!(app.stripe.succeeded_charges(), 3);
    assert_eq!(app.staged_jobs().await.len(), 3);
}
