//! A key's lock and its recovery: a key in use, an unlock the database lost, stale locks resumed,
//! a key an older server left, and attempts whose lock was taken over, which commit nothing.

use std::time::Duration;

use api_server::{grpc::reason, testing::*};
use schema::RecoveryPoint;
use tonic::Code;
use tonic_types::StatusExt;

#[tokio::test(flavor = "multi_thread")]
async fn a_key_locked_by_a_live_attempt_is_in_use() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    // An attempt that has claimed the key and is still running (its lock is fresh).
    app.claim(&user, &key, &ride_params()).await;

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();

    assert_status(&status, Code::Aborted, reason::IDEMPOTENCY_KEY_IN_USE);
    let details = status.get_error_details();
    assert!(details.retry_info().unwrap().retry_delay.is_some());
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::RideCreated);
    let rides = app.rides().await;
    assert_eq!(rides.len(), 1, "the claim's ride only");
    assert_eq!(rides[0].stripe_charge_id, None);
    assert_eq!(app.stripe.create_calls(), 0);
}

fn ride_params() -> api_server::rides::RideParams {
    let request = ride_request();
    api_server::rides::RideParams::new(
        request.origin_lat,
        request.origin_lon,
        request.target_lat,
        request.target_lon,
    )
    .unwrap()
}

/// A failover as one server sees it: the database is out of reach from the charge on, so the
/// charge cannot be recorded and the key cannot be unlocked either. Once the database is back,
/// the key is unlocked in the background, long before its lock would expire (60 s here, 90 s by
/// default), and the retry charges once instead of being refused `IDEMPOTENCY_KEY_IN_USE` until
/// then.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_whose_unlock_failed_with_the_database_is_unlocked_once_the_database_is_back() {
    let app = TestApp::spawn_with(
        fake_stripe::Config {
            latency: Duration::from_millis(800),
            ..Default::default()
        },
        &[
            ("DATABASE_POOL_SIZE", "1"),
            ("DATABASE_POOL_TIMEOUT_MS", "300"),
            ("IDEMPOTENCY_LOCK_TIMEOUT_SECS", "60"),
        ],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let attempt = {
        let (app_client, user, key) = (app.client().await, user.clone(), key.clone());
        tokio::spawn(async move {
            let mut client = app_client;
            client
                .create_ride(authed(&user.token, Some(&key), ride_request()))
                .await
        })
    };
    while app.stripe.create_calls() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The server's only connection, taken while the charge is in flight: the phase that records
    // the charge and the unlock after it both find no connection.
    let outage = app.rides.pool().get().await.unwrap();

    let status = attempt.await.unwrap().unwrap_err();
    assert_status(&status, Code::Unavailable, reason::DATABASE_UNAVAILABLE);
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::RideCreated);
    assert!(
        key_row.locked_at.is_some(),
        "the unlock failed with the phase"
    );
    // Longer than the first few retries of the unlock, which fail too.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(app.key_row(&user, &key).await.unwrap().lock_token.is_some());
    drop(outage);

    // Only an unlock clears `lock_token`; an expired lock keeps it.
    let mut polls = 0;
    while app.key_row(&user, &key).await.unwrap().lock_token.is_some() {
        polls += 1;
        assert!(
            polls < 300,
            "the key is still locked 30 s after the database came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let response = app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert!(!replayed(&response));
    assert_eq!(
        app.stripe.succeeded_charges(),
        1,
        "the retry's charge is the first one's"
    );
    assert_eq!(app.rides().await.len(), 1);
    assert_eq!(app.staged_jobs().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn unlocked_and_stale_locked_keys_resume_at_ride_created_with_one_charge() {
    let app = TestApp::spawn().await;
    let params = ride_params();
    for stale_lock in [true, false] {
        let user = app.create_user(GOOD_CARD).await;
        let key = new_key();
        let charges_before = app.stripe.succeeded_charges();
        // An attempt that claimed the key (and so committed its ride) and then died.
        let lease = app.claim(&user, &key, &params).await;
        let key_row = app.key_row(&user, &key).await.unwrap();
        assert_eq!(key_row.recovery_point, RecoveryPoint::RideCreated);
        if stale_lock {
            app.expire_lock(key_row.id).await;
        } else {
            api_server::idempotency::release(&app.pool, Default::default(), &lease)
                .await
                .unwrap();
        }

        let response = app.create_ride(&user, &key, ride_request()).await.unwrap();

        assert!(!replayed(&response));
        let ride = response.into_inner().ride.unwrap();
        assert_eq!(
            app.stripe.succeeded_charges(),
            charges_before + 1,
            "stale lock: {stale_lock}"
        );
        let key_row = app.key_row(&user, &key).await.unwrap();
        assert_eq!(key_row.recovery_point, RecoveryPoint::Finished);
        let rides: Vec<_> = app
            .rides()
            .await
            .into_iter()
            .filter(|r| r.idempotency_key_id == Some(key_row.id))
            .collect();
        assert_eq!(rides.len(), 1);
        assert_eq!(
            rides[0].stripe_charge_id.as_deref(),
            Some(ride.charge_id.as_str())
        );
        let jobs = app.staged_jobs().await;
        assert_eq!(
            jobs.iter()
                .filter(|j| j.job_args["ride_id"] == ride.id)
                .count(),
            1
        );
    }
}

/// A key a server from before run 24 of docs/history/performance.md left at `started` or
/// `charge_created` has no phase in this server: every call on it is answered retryable
/// `UNAVAILABLE` / `IDEMPOTENCY_KEY_NEEDS_UPGRADE`, writes nothing, charges nothing, and leaves
/// the key unlocked for an older server's retry or for `workers admin keys upgrade`.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_an_older_server_left_is_answered_unavailable_and_nothing_moves() {
    let app = TestApp::spawn().await;
    let params = ride_params();
    for point in [RecoveryPoint::Started, RecoveryPoint::ChargeCreated] {
        let user = app.create_user(GOOD_CARD).await;
        let key = new_key();
        let mut lease = app.claim(&user, &key, &params).await;
        let request = app.rides_request(&user, params).await;
        app.leave_as_an_older_server(&mut lease, &request, point)
            .await;
        app.expire_lock(lease.key_id).await;
        let (rides, jobs, charges) = (
            app.rides().await,
            app.staged_jobs().await.len(),
            app.stripe.create_calls(),
        );

        for _ in 0..2 {
            let status = app
                .create_ride(&user, &key, ride_request())
                .await
                .unwrap_err();
            assert_status(
                &status,
                Code::Unavailable,
                reason::IDEMPOTENCY_KEY_NEEDS_UPGRADE,
            );
            let details = status.get_error_details();
            assert!(details.retry_info().unwrap().retry_delay.is_some());
        }

        assert_eq!(app.rides().await, rides, "{point}: no ride written");
        assert_eq!(app.staged_jobs().await.len(), jobs, "{point}: no receipt");
        assert_eq!(app.stripe.create_calls(), charges, "{point}: no charge");
        let key_row = app.key_row(&user, &key).await.unwrap();
        assert_eq!(key_row.recovery_point, point);
        assert_eq!(key_row.locked_at, None, "{point}: left unlocked");
        assert_eq!(key_row.response_code, None);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_attempt_whose_lock_was_taken_over_commits_nothing() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let params = ride_params();
    let request = app.rides_request(&user, params).await;
    let mut first = app.claim(&user, &key, &params).await;
    app.expire_lock(first.key_id).await;
    let mut second = app.claim(&user, &key, &params).await;
    assert_ne!(first.token, second.token);

    let error = app.rides.step(&mut first, &request).await.unwrap_err();

    assert!(matches!(
        error,
        api_server::rides::CreateRideError::LockLost
    ));
    assert_eq!(
        app.stripe.succeeded_charges(),
        1,
        "its charge used the provider key the attempt that took over uses"
    );
    assert!(
        app.rides().await[0].stripe_charge_id.is_none(),
        "but it recorded nothing"
    );
    assert!(app.staged_jobs().await.is_empty(), "and staged no receipt");
    assert_eq!(
        app.key_row(&user, &key).await.unwrap().recovery_point,
        RecoveryPoint::RideCreated
    );
    // The attempt that took over proceeds normally, and the provider replays the one charge.
    app.rides.step(&mut second, &request).await.unwrap();
    assert_eq!(app.stripe.succeeded_charges(), 1);
    let rides = app.rides().await;
    assert_eq!(rides.len(), 1);
    assert!(rides[0].stripe_charge_id.is_some());
    assert_eq!(app.staged_jobs().await.len(), 1);
}

/// A phase is one statement whose fence waits for the key row's lock. If a takeover holds that
/// lock, the fence waits for it and then re-checks the token on the row the takeover committed
/// (not on the statement's older snapshot), so the fenced-off phase writes nothing at all.
#[tokio::test(flavor = "multi_thread")]
async fn a_phase_that_waits_for_a_takeover_in_progress_writes_nothing() {
    use diesel::sql_types::BigInt;
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};

    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let params = ride_params();
    let request = app.rides_request(&user, params).await;
    {
        let mut first = app.claim(&user, &key, &params).await;
        let rides_before = app.rides().await;
        let jobs_before = app.staged_jobs().await.len();
        let point_before = first.recovery_point;

        // A takeover's transaction, not yet committed: it holds the row lock and a new token.
        let mut takeover = app.db.connect().await;
        takeover.batch_execute("BEGIN").await.unwrap();
        diesel::sql_query(
            "UPDATE idempotency_keys SET lock_token = gen_random_uuid(), locked_at = now() \
             WHERE id = $1",
        )
        .bind::<BigInt, _>(first.key_id)
        .execute(&mut takeover)
        .await
        .unwrap();

        let (rides, phase_request) = (app.rides.clone(), request.clone());
        let waiting = tokio::spawn(async move {
            let result = rides.step(&mut first, &phase_request).await;
            (result, first)
        });
        // Only commit once the phase is blocked on the row lock.
        let mut watcher = app.db.connect().await;
        for _ in 0..500 {
            #[derive(diesel::QueryableByName)]
            struct Waiting {
                #[diesel(sql_type = BigInt)]
                n: i64,
            }
            let waiting: Waiting = diesel::sql_query(
                "SELECT count(*) AS n FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .get_result(&mut watcher)
            .await
            .unwrap();
            if waiting.n > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        takeover.batch_execute("COMMIT").await.unwrap();

        let (result, first) = waiting.await.unwrap();
        assert!(
            matches!(result, Err(api_server::rides::CreateRideError::LockLost)),
            "{result:?}"
        );
        assert_eq!(
            app.rides().await,
            rides_before,
            "no ride written or charged"
        );
        assert_eq!(app.staged_jobs().await.len(), jobs_before);
        let key_row = app.key_row(&user, &key).await.unwrap();
        assert_eq!(key_row.recovery_point, point_before);
        assert_ne!(key_row.lock_token, Some(first.token));
    }
}
