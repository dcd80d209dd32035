//! The completer against the real api-server (TestApp) and fake-stripe.

mod lock_rule;

use std::time::Duration;

use api_server::{
    rides::RideParams,
    testing::{DECLINED_CARD, GOOD_CARD, INTERNAL_API_TOKEN, TestApp, TestUser, new_key},
};
use diesel::{ExpressionMethods, QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use schema::{RecoveryPoint, models::KeyNeedingAttention, schema::keys_needing_attention};
use workers::{
    completer::Completer,
    config::{CompleterConfig, Secret},
};

pub(crate) fn config(app: &TestApp) -> CompleterConfig {
    CompleterConfig {
        api_server_url: format!("http://{}", app.addr),
        api_server_tls: Default::default(),
        internal_api_token: Some(Secret::new(INTERNAL_API_TOKEN)),
        min_age: Duration::from_secs(300),
        idle: Duration::from_secs(60),
        lock_rule: contract::key::LockRule::new(
            Duration::from_secs(90),
            Duration::from_secs(86_400),
        ),
        batch_size: 100,
        backoff_base: Duration::from_secs(60),
        backoff_max: Duration::from_secs(3600),
        max_attempts: 8,
        lease: Duration::from_secs(300),
        rpc_timeout: Duration::from_secs(20),
        interval: Duration::from_secs(1),
    }
}

fn params() -> RideParams {
    RideParams::new(
        Some(37.7749),
        Some(-122.4194),
        Some(37.3382),
        Some(-121.8863),
    )
    .unwrap()
}

/// A key abandoned at `point` (its attempt died holding the lock, long ago): at `ride_created` as
/// this server's attempts leave keys, at `started` or `charge_created` as only an older server
/// left them (`TestApp::leave_as_an_older_server`). Returns the key and its id.
pub(crate) async fn abandoned_key(
    app: &TestApp,
    user: &TestUser,
    point: RecoveryPoint,
) -> (String, i64) {
    let key = new_key();
    let mut lease = app.claim(user, &key, &params()).await;
    if point != RecoveryPoint::RideCreated {
        let request = app.rides_request(user, params()).await;
        app.leave_as_an_older_server(&mut lease, &request, point)
            .await;
    }
    app.expire_lock(lease.key_id).await;
    age(app, lease.key_id, "6 minutes", "2 minutes").await;
    (key, lease.key_id)
}

async fn age(app: &TestApp, key_id: i64, created: &str, last_run: &str) {
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(format!(
        "UPDATE idempotency_keys SET created_at = now() - interval '{created}', \
         last_run_at = now() - interval '{last_run}' WHERE id = $1"
    ))
    .bind::<diesel::sql_types::BigInt, _>(key_id)
    .execute(&mut conn)
    .await
    .unwrap();
}

/// Makes a backed-off key due again, as if its back-off had elapsed.
async fn make_due(app: &TestApp, key_id: i64) {
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(
        "UPDATE idempotency_keys SET completer_next_attempt_at = now() - interval '1 second', \
         last_run_at = now() - interval '2 minutes' WHERE id = $1",
    )
    .bind::<diesel::sql_types::BigInt, _>(key_id)
    .execute(&mut conn)
    .await
    .unwrap();
}

async fn point(app: &TestApp, user: &TestUser, key: &str) -> RecoveryPoint {
    app.key_row(user, key).await.unwrap().recovery_point
}

#[tokio::test(flavor = "multi_thread")]
async fn resumes_abandoned_keys_to_exactly_one_charge_and_defers_an_older_servers_keys() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let mut abandoned = Vec::new();
    for _ in 0..2 {
        abandoned.push(abandoned_key(&app, &user, RecoveryPoint::RideCreated).await);
    }
    let mut older = Vec::new();
    for recovery_point in [RecoveryPoint::Started, RecoveryPoint::ChargeCreated] {
        older.push((
            abandoned_key(&app, &user, recovery_point).await,
            recovery_point,
        ));
    }
    // Only the charge_created key was charged before the crash.
    assert_eq!(app.stripe.succeeded_charges(), 1);

    let completer = Completer::new(app.pool.clone(), config(&app)).unwrap();
    let summary = completer.run_once().await.unwrap();
    assert_eq!(summary.claimed, 4);
    assert_eq!(summary.completed, 2);
    assert_eq!(
        summary.deferred, 2,
        "the older server's keys await the upgrade"
    );
    for (key, _) in &abandoned {
        assert_eq!(point(&app, &user, key).await, RecoveryPoint::Finished);
    }
    for ((key, _), recovery_point) in &older {
        assert_eq!(point(&app, &user, key).await, *recovery_point);
    }
    assert_eq!(
        app.stripe.succeeded_charges(),
        3,
        "one charge per ride, none twice"
    );
    let rides = app.rides().await;
    assert_eq!(rides.len(), 3, "the started key has no ride");
    assert_eq!(
        rides
            .iter()
            .filter(|r| r.stripe_charge_id.is_some())
            .count(),
        3
    );
    assert_eq!(
        app.staged_jobs().await.len(),
        2,
        "each completed ride's receipt is staged"
    );
    // A deferral is not an attempt: no key is given up to a person for the upgrade's sake.
    for ((_, key_id), _) in &older {
        let attempts: i32 = {
            let mut conn = app.pool.get().await.unwrap();
            schema::schema::idempotency_keys::table
                .filter(schema::schema::idempotency_keys::id.eq(key_id))
                .select(schema::schema::idempotency_keys::completer_attempts)
                .first(&mut conn)
                .await
                .unwrap()
        };
        assert_eq!(attempts, 0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn respects_the_age_idle_and_lock_thresholds() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (young, young_id) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    age(&app, young_id, "4 minutes", "2 minutes").await;
    let (recent, recent_id) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    age(&app, recent_id, "6 minutes", "30 seconds").await;
    let (locked, locked_id) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    {
        let mut conn = app.pool.get().await.unwrap();
        diesel::sql_query(
            "UPDATE idempotency_keys SET locked_at = now() - interval '30 seconds' WHERE id = $1",
        )
        .bind::<diesel::sql_types::BigInt, _>(locked_id)
        .execute(&mut conn)
        .await
        .unwrap();
    }
    let (due, _) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;

    let completer = Completer::new(app.pool.clone(), config(&app)).unwrap();
    let summary = completer.run_once().await.unwrap();
    assert_eq!((summary.claimed, summary.completed), (1, 1));
    assert_eq!(point(&app, &user, &due).await, RecoveryPoint::Finished);
    for key in [&young, &recent, &locked] {
        assert_eq!(point(&app, &user, key).await, RecoveryPoint::RideCreated);
    }

    // The other side of each threshold: 6 minutes old, run 2 minutes ago, lock expired.
    age(&app, young_id, "6 minutes", "2 minutes").await;
    age(&app, recent_id, "6 minutes", "2 minutes").await;
    app.expire_lock(locked_id).await;
    let summary = completer.run_once().await.unwrap();
    assert_eq!((summary.claimed, summary.completed), (3, 3));
    for key in [&young, &recent, &locked] {
        assert_eq!(point(&app, &user, key).await, RecoveryPoint::Finished);
    }
    assert_eq!(app.stripe.succeeded_charges(), 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn counts_declines_as_final() {
    let app = TestApp::spawn().await;
    let user = app.create_user(DECLINED_CARD).await;
    let (key, _) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    let completer = Completer::new(app.pool.clone(), config(&app)).unwrap();
    let summary = completer.run_once().await.unwrap();
    assert_eq!(
        (summary.declined, summary.completed, summary.still_failing),
        (1, 0, 0)
    );
    assert_eq!(point(&app, &user, &key).await, RecoveryPoint::Finished);
    assert_eq!(app.stripe.succeeded_charges(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn backs_off_and_gives_up_into_the_attention_list() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, key_id) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    app.stripe
        .inject_faults(fake_stripe::FaultMode::Error500, 1000);
    let completer = Completer::new(
        app.pool.clone(),
        CompleterConfig {
            max_attempts: 3,
            ..config(&app)
        },
    )
    .unwrap();

    let first = completer.run_once().await.unwrap();
    assert_eq!(first.still_failing, 1);
    // Backed off: not due again straight away even though it is old and idle.
    age(&app, key_id, "6 minutes", "2 minutes").await;
    assert_eq!(completer.run_once().await.unwrap().claimed, 0);

    make_due(&app, key_id).await;
    assert_eq!(completer.run_once().await.unwrap().still_failing, 1);
    make_due(&app, key_id).await;
    let last = completer.run_once().await.unwrap();
    assert_eq!((last.gave_up, last.still_failing), (1, 0));

    let mut conn = app.pool.get().await.unwrap();
    let attention: Vec<KeyNeedingAttention> = keys_needing_attention::table
        .select(KeyNeedingAttention::as_select())
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(attention.len(), 1);
    assert_eq!(attention[0].reason, "completer_gave_up");
    assert_eq!(attention[0].idempotency_key_id, key_id);
    assert_eq!(attention[0].idempotency_key, key);
    assert_eq!(attention[0].user_id, user.id);
    assert_eq!(attention[0].recovery_point, RecoveryPoint::RideCreated);
    assert!(
        attention[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("Unavailable")
    );

    // Given up: never picked again.
    make_due(&app, key_id).await;
    assert_eq!(completer.run_once().await.unwrap().claimed, 0);
    assert_eq!(app.stripe.succeeded_charges(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_completers_never_work_the_same_key() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    for _ in 0..6 {
        abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    }
    let first = Completer::new(
        app.pool.clone(),
        CompleterConfig {
            batch_size: 4,
            ..config(&app)
        },
    )
    .unwrap();
    let second = Completer::new(
        app.pool.clone(),
        CompleterConfig {
            batch_size: 4,
            ..config(&app)
        },
    )
    .unwrap();
    let (a, b) = tokio::join!(first.run_once(), second.run_once());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.claimed + b.claimed, 6, "{a:?} {b:?}");
    assert_eq!(a.completed + b.completed, 6);
    assert_eq!(a.skipped_in_use + b.skipped_in_use, 0);
    assert_eq!(app.stripe.succeeded_charges(), 6);
    assert_eq!(app.rides().await.len(), 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_credential_spends_no_attempts() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let (key, _) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    let completer = Completer::new(
        app.pool.clone(),
        CompleterConfig {
            internal_api_token: Some(Secret::new("not-the-internal-token-0123456789abcdef")),
            ..config(&app)
        },
    )
    .unwrap();
    assert!(completer.run_once().await.is_err());
    assert_eq!(point(&app, &user, &key).await, RecoveryPoint::RideCreated);
    let good = Completer::new(app.pool.clone(), config(&app)).unwrap();
    assert_eq!(good.run_once().await.unwrap().completed, 1);
}

/// How many attempts the completer has counted on a key.
async fn attempts(app: &TestApp, key_id: i64) -> i32 {
    #[derive(diesel::QueryableByName)]
    struct Attempts {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        completer_attempts: i32,
    }
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query("SELECT completer_attempts FROM idempotency_keys WHERE id = $1")
        .bind::<diesel::sql_types::BigInt, _>(key_id)
        .get_result::<Attempts>(&mut conn)
        .await
        .unwrap()
        .completer_attempts
}

#[tokio::test(flavor = "multi_thread")]
async fn rate_limits_and_an_unreachable_server_spend_no_attempts() {
    // The completer's calls for one user share a bucket of one CreateRide.
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[
            ("RATE_LIMIT_CREATE_PER_SEC", "0.001"),
            ("RATE_LIMIT_CREATE_BURST", "1"),
        ],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let (_, first) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    let (second_key, second) = abandoned_key(&app, &user, RecoveryPoint::RideCreated).await;
    age(&app, second, "5 minutes", "2 minutes").await;
    let completer = Completer::new(app.pool.clone(), config(&app)).unwrap();
    let summary = completer.run_once().await.unwrap();
    assert_eq!((summary.completed, summary.deferred), (1, 1), "{summary:?}");
    assert_eq!(summary.gave_up, 0);
    assert_eq!(attempts(&app, first).await, 1);
    assert_eq!(attempts(&app, second).await, 0, "a rate limit counted");
    assert_eq!(
        point(&app, &user, &second_key).await,
        RecoveryPoint::RideCreated
    );

    // An api-server nobody answers at: deferred, not counted either.
    make_due(&app, second).await;
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let nowhere = closed.local_addr().unwrap();
    drop(closed);
    let unreachable = Completer::new(
        app.pool.clone(),
        CompleterConfig {
            api_server_url: format!("http://{nowhere}"),
            ..config(&app)
        },
    )
    .unwrap();
    let summary = unreachable.run_once().await.unwrap();
    assert_eq!(summary.deferred, 1, "{summary:?}");
    assert_eq!(
        attempts(&app, second).await,
        0,
        "an unreachable server counted"
    );
}
