//! A lock whose holder is gone is taken over at once, never charging twice: the holder is the
//! real api-server binary on the test's database, caught mid-charge by a slow provider, then
//! killed, paused or cut off from PostgreSQL; the retry goes to a second server (`TestApp`). Both
//! run at the default lock timeout (90 s), so a retry answered before it would have expired was
//! not waiting for it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    process::{Child, Command},
    time::{Duration, Instant},
};

use api_server::{
    grpc::{IDEMPOTENCY_WAIT_HEADER, reason},
    testing::*,
};
use common::*;
use diesel_async::RunQueryDsl;
use proto::v1::CreateRideResponse;
use schema::RecoveryPoint;
use tonic::{Code, Response, Status};

const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(90);
/// The lock timeout and the provider timeout at their defaults (the harness shortens both).
const AT_THE_DEFAULTS: &[(&str, &str)] = &[
    ("IDEMPOTENCY_LOCK_TIMEOUT_SECS", "90"),
    ("STRIPE_TIMEOUT_MS", "30000"),
];

fn signal(child: &Child, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal}");
}

/// `key` retried on `app` as a rider's backend does (every 0.5 s, each attempt with a 10 s
/// deadline) until an answer other than `ABORTED`/`UNAVAILABLE` comes back, for at most two lock
/// timeouts; that answer and when it came.
async fn retried_until_answered(
    app: &TestApp,
    user: &TestUser,
    key: &str,
) -> (Result<Response<CreateRideResponse>, Status>, Instant) {
    let give_up = Instant::now() + 2 * DEFAULT_LOCK_TIMEOUT;
    loop {
        let mut request = authed(&user.token, Some(key), ride_request());
        request.set_timeout(Duration::from_secs(10));
        let answer = app.client().await.create_ride(request).await;
        let retryable = matches!(&answer, Err(status)
            if matches!(status.code(), Code::Aborted | Code::Unavailable | Code::DeadlineExceeded));
        if !retryable || Instant::now() > give_up {
            return (answer, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One attempt at `key` on `app` that waits at most `wait_ms` for the key's holder.
async fn attempt_waiting(
    app: &TestApp,
    user: &TestUser,
    key: &str,
    wait_ms: &str,
) -> Result<Response<CreateRideResponse>, Status> {
    let mut request = authed(&user.token, Some(key), ride_request());
    request
        .metadata_mut()
        .insert(IDEMPOTENCY_WAIT_HEADER, wait_ms.parse().unwrap());
    app.client().await.create_ride(request).await
}

/// Exactly one PaymentIntent, succeeded, and it is `ride`'s charge; one ride.
async fn assert_charged_once(app: &TestApp, answer: Result<Response<CreateRideResponse>, Status>) {
    let ride = answer.unwrap().into_inner().ride.unwrap();
    let intents = app.stripe.payment_intents();
    assert_eq!(intents.len(), 1, "one PaymentIntent: {intents:?}");
    assert_eq!(app.stripe.succeeded_charges(), 1, "one charge");
    assert_eq!(intents[0].id, ride.charge_id);
    assert_eq!(app.rides().await.len(), 1, "one ride");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_holders_key_is_served_by_a_retry_on_another_server_before_its_lock_expires() {
    let app = app_with_a_slow_provider(AT_THE_DEFAULTS).await;
    let (mut holder, client) = spawn_second_server(&app, AT_THE_DEFAULTS).await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let first = first_attempt_at_the_provider(&app, client, &user, &key).await;

    signal(&holder.0, "-KILL");
    holder.0.wait().unwrap();
    let killed = Instant::now();
    assert!(first.await.unwrap().is_err(), "the killed holder answered");

    let (answer, answered) = retried_until_answered(&app, &user, &key).await;
    let served_after = answered - killed;
    println!("the rider was served {served_after:?} after the kill");
    assert_charged_once(&app, answer).await;
    assert!(
        served_after < DEFAULT_LOCK_TIMEOUT,
        "served only after the lock timeout: {served_after:?}"
    );
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_holder_keeps_its_key_answers_its_ride_and_is_charged_once() {
    let app = app_with_a_slow_provider(AT_THE_DEFAULTS).await;
    let (holder, client) = spawn_second_server(&app, AT_THE_DEFAULTS).await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let first = first_attempt_at_the_provider(&app, client, &user, &key).await;
    let held = app.key_row(&user, &key).await.unwrap().lock_token;

    signal(&holder.0, "-STOP");
    // Its liveness session stands (the kernel answers for its socket): nobody takes it over.
    tokio::time::sleep(PROVIDER_LATENCY + Duration::from_millis(500)).await;
    let during = attempt_waiting(&app, &user, &key, "1000")
        .await
        .unwrap_err();
    assert_status(&during, Code::Aborted, reason::IDEMPOTENCY_KEY_IN_USE);
    assert_eq!(app.key_row(&user, &key).await.unwrap().lock_token, held);
    signal(&holder.0, "-CONT");

    let first = first.await.unwrap().unwrap();
    let replay = app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert!(replayed(&replay));
    assert_eq!(first.get_ref().ride, replay.get_ref().ride);
    assert_charged_once(&app, Ok(first)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_holder_cut_off_from_postgres_mid_charge_records_nothing_and_the_retry_charges_once() {
    let app = app_with_a_slow_provider(AT_THE_DEFAULTS).await;
    let url = format!("{}?application_name=cut_off_holder", app.db.url());
    let env = [AT_THE_DEFAULTS, &[("DATABASE_URL", url.as_str())]].concat();
    let (_holder, client) = spawn_second_server(&app, &env).await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let first = first_attempt_at_the_provider(&app, client, &user, &key).await;

    // Every connection of the holder ends, its liveness session's with them, while its charge
    // is at the provider.
    let mut conn = app.db.connect().await;
    // The holder's sessions are picked first (MATERIALIZED), so that no other is terminated.
    let terminated = diesel::sql_query(
        "WITH holder AS MATERIALIZED (SELECT pid FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'cut_off_holder') \
         SELECT pid FROM holder WHERE pg_terminate_backend(pid)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    assert!(terminated >= 1, "the holder had no connection");

    let first = first.await.unwrap().unwrap_err();
    assert_status(&first, Code::Unavailable, reason::DATABASE_UNAVAILABLE);
    // It recorded nothing: the charge it made is not on the ride, the key not finished.
    let row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::RideCreated);
    assert_eq!(app.rides().await[0].stripe_charge_id, None);
    assert_eq!(app.stripe.succeeded_charges(), 1, "the holder's charge");

    let (answer, _) = retried_until_answered(&app, &user, &key).await;
    assert_charged_once(&app, answer).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_holders_key_beyond_the_provider_key_margin_waits_for_the_lock_timeout() {
    // The provider remembers keys for 1 s, so a key is beyond the margin (0.9 s) a second after
    // its claim; the lock timeout is short so that the test sees it expire.
    const SHORT: &[(&str, &str)] = &[
        ("STRIPE_IDEMPOTENCY_WINDOW_SECS", "1"),
        ("IDEMPOTENCY_LOCK_TIMEOUT_SECS", "6"),
    ];
    let app = app_with_a_slow_provider(SHORT).await;
    let (mut holder, client) = spawn_second_server(&app, SHORT).await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let first = first_attempt_at_the_provider(&app, client, &user, &key).await;
    let locked_at = app.key_row(&user, &key).await.unwrap().locked_at.unwrap();

    signal(&holder.0, "-KILL");
    holder.0.wait().unwrap();
    assert!(first.await.unwrap().is_err());
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The holder is gone, but the key is too old to rely on the provider's idempotency key:
    // nobody may charge it while the dead holder's charge may still be running.
    let refused = attempt_waiting(&app, &user, &key, "1000")
        .await
        .unwrap_err();
    assert_status(&refused, Code::Aborted, reason::IDEMPOTENCY_KEY_IN_USE);

    let (answer, _) = retried_until_answered(&app, &user, &key).await;
    assert_charged_once(&app, answer).await;
    let row = app.key_row(&user, &key).await.unwrap();
    assert!(
        row.last_run_at >= locked_at + chrono::Duration::seconds(6),
        "taken over before the lock expired: locked {locked_at}, taken {}",
        row.last_run_at
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_server_from_before_holder_ids_that_takes_a_lock_over_has_its_holder_forgotten() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let r = ride_request();
    let params =
        api_server::rides::RideParams::new(r.origin_lat, r.origin_lon, r.target_lat, r.target_lon)
            .unwrap();
    let key = new_key();
    let lease = app.claim(&user, &key, &params).await;
    let holder = app.key_row(&user, &key).await.unwrap().lock_holder;
    assert!(
        holder.is_some(),
        "this server's lock names its liveness session"
    );
    let take_over = "UPDATE idempotency_keys SET lock_token = gen_random_uuid(), locked_at = now() \
                     WHERE id = $1";
    // A session of this version that changes the lock keeps the holder it writes (here none).
    diesel::sql_query(take_over)
        .bind::<diesel::sql_types::BigInt, _>(lease.key_id)
        .execute(&mut app.db.connect().await)
        .await
        .unwrap();
    assert_eq!(app.key_row(&user, &key).await.unwrap().lock_holder, holder);
    // A server from before holder ids (but with deployment ids, or the fence against older
    // servers would refuse it the lock) does not name holders: the one it replaced is forgotten,
    // so its own lock is judged by the lock timeout alone and never taken for the dead holder's.
    let mut older = app.db.connect_as_an_older_process().await;
    diesel::sql_query("SET rocket_rides.provider_keys = 'deployment'")
        .execute(&mut older)
        .await
        .unwrap();
    diesel::sql_query(take_over)
        .bind::<diesel::sql_types::BigInt, _>(lease.key_id)
        .execute(&mut older)
        .await
        .unwrap();
    assert_eq!(app.key_row(&user, &key).await.unwrap().lock_holder, None);
}
