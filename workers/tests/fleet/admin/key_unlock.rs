//! Taking a key from its holder: `keys unlock` is a dry run until `--yes`, refuses a live lock
//! unless forced, and a forced unlock or finish fences the old holder out; a finished key is
//! neither unlocked nor finished again.

use api_server::{
    idempotency::Lease,
    rides::CreateRideError,
    testing::{GOOD_CARD, TestApp, TestUser, new_key, replayed, ride_request},
};
use schema::RecoveryPoint;
use workers::admin::{
    FinishOutcome, Mode,
    keys::{self, FinishRequest},
};

use super::{abandoned_at, assert_refused, db_settings, finish, finish_request, key_at, params};

#[tokio::test(flavor = "multi_thread")]
async fn unlock_is_a_dry_run_until_yes_and_the_key_then_resumes() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, key_id) = abandoned_at(&app, &user, RecoveryPoint::RideCreated).await;
    let before = app.key_row(&user, &key).await.unwrap();
    assert!(before.locked_at.is_some());

    let dry = keys::unlock(&app.pool, &db_settings(), key_id, false, Mode::DryRun)
        .await
        .unwrap();
    assert_eq!(dry.mode, Mode::DryRun);
    let columns: Vec<_> = dry.changes.iter().map(|c| c.column.unwrap()).collect();
    assert_eq!(columns, ["locked_at", "lock_token"]);
    assert!(dry.warnings.is_empty(), "an expired lock needs no force");
    let after_dry = app.key_row(&user, &key).await.unwrap();
    assert_eq!(
        after_dry.locked_at, before.locked_at,
        "a dry run changes nothing"
    );
    assert_eq!(after_dry.lock_token, before.lock_token);

    let applied = keys::unlock(&app.pool, &db_settings(), key_id, false, Mode::Apply)
        .await
        .unwrap();
    assert_eq!(applied.mode, Mode::Apply);
    let unlocked = app.key_row(&user, &key).await.unwrap();
    assert_eq!((unlocked.locked_at, unlocked.lock_token), (None, None));
    assert_eq!(unlocked.recovery_point, RecoveryPoint::RideCreated);

    // Unlocking again is refused: there is nothing to unlock.
    assert_refused(
        keys::unlock(&app.pool, &db_settings(), key_id, false, Mode::Apply).await,
        "not locked",
    );
    // The client's retry resumes the key at once and the ride is charged exactly once.
    let response = app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert!(!replayed(&response));
    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(
        app.key_row(&user, &key).await.unwrap().recovery_point,
        RecoveryPoint::Finished
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unlock_refuses_a_live_lock_unless_forced_and_fences_out_its_holder() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, mut lease) = key_at(&app, &user, RecoveryPoint::RideCreated).await;

    for mode in [Mode::DryRun, Mode::Apply] {
        assert_refused(
            keys::unlock(&app.pool, &db_settings(), lease.key_id, false, mode).await,
            "may still be running",
        );
    }
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.lock_token, Some(lease.token), "refused: still locked");

    let forced = keys::unlock(&app.pool, &db_settings(), lease.key_id, true, Mode::Apply)
        .await
        .unwrap();
    assert_eq!(forced.warnings.len(), 1);
    assert!(forced.warnings[0].contains("--force"));
    assert_eq!(app.key_row(&user, &key).await.unwrap().locked_at, None);
    // The old holder's next phase commits nothing (its charge, made before the fence, is the
    // provider's replay for whoever resumes the key).
    assert_the_old_holder_commits_nothing(&app, &user, &mut lease).await;
}

/// Runs the phase of `lease`, whose lock an operator took away, and checks that it is fenced out:
/// no charge recorded, no receipt staged.
async fn assert_the_old_holder_commits_nothing(app: &TestApp, user: &TestUser, lease: &mut Lease) {
    let request = app.rides_request(user, params()).await;
    let step = app.rides.step(lease, &request).await;
    assert!(matches!(step, Err(CreateRideError::LockLost)), "{step:?}");
    let rides = app.rides().await;
    assert!(rides.iter().all(|r| r.stripe_charge_id.is_none()));
    assert!(app.staged_jobs().await.is_empty());
}

/// `key finish --force` takes the live lock over with its own token and finishes the key with the
/// api-server's `FinishKey` statement: the old holder is fenced out exactly as after an unlock.
#[tokio::test(flavor = "multi_thread")]
async fn a_forced_finish_fences_out_the_live_holder() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, mut lease) = key_at(&app, &user, RecoveryPoint::RideCreated).await;

    let request = FinishRequest {
        force: true,
        ..finish_request(lease.key_id, FinishOutcome::Declined)
    };
    let applied = finish(&app, &request, Mode::Apply).await.unwrap();
    assert_eq!(applied.warnings.len(), 1);
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!((row.locked_at, row.lock_token), (None, None));
    // The old holder's next phase commits nothing: no charge recorded on a key finished as
    // declined (a charge it made before the fence is the reconciler's to find).
    assert_the_old_holder_commits_nothing(&app, &user, &mut lease).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_key_is_neither_unlocked_nor_finished_again() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.create_ride(&user, &key, ride_request()).await.unwrap();
    let before = app.key_row(&user, &key).await.unwrap();

    for mode in [Mode::DryRun, Mode::Apply] {
        assert_refused(
            keys::unlock(&app.pool, &db_settings(), before.id, true, mode).await,
            "is finished",
        );
        for outcome in [FinishOutcome::Succeeded, FinishOutcome::Declined] {
            let mut request = finish_request(before.id, outcome);
            request.force = true;
            assert_refused(finish(&app, &request, mode).await, "already finished");
        }
    }
    let after = app.key_row(&user, &key).await.unwrap();
    assert_eq!(after.response_body, before.response_body);
    assert_eq!(app.staged_jobs().await.len(), 1);
}
