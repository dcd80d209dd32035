//! The client against the real api-server over loopback gRPC, its own PostgreSQL database and
//! fake-stripe (`api_server::testing::TestApp`). Waits are asserted from the client's attempt
//! log, never from the clock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use api_server::testing::{
    DECLINED_CARD, GOOD_CARD, INTERNAL_API_TOKEN, TestApp, TestCa, TestUser, TlsFiles, ride_request,
};
use fake_stripe::FaultMode;
use proto::v1::CreateRideRequest;
use rides_client::{
    AttemptRecord, CallError, ClientTls, Credential, RetryPolicy, RidesClient, RidesError, new_key,
};
use schema::RecoveryPoint;

async fn client(app: &TestApp, user: &TestUser) -> RidesClient {
    RidesClient::new(app.channel().await, Credential::user(&user.token))
}

fn other_ride() -> CreateRideRequest {
    CreateRideRequest {
        target_lat: Some(40.0),
        ..ride_request()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_provider_outage_is_retried_with_the_same_key_and_charged_once() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    app.stripe.inject_faults(FaultMode::Error500, 2);

    let created = client(&app, &user)
        .await
        .create_ride(ride_request())
        .await
        .unwrap();

    assert_eq!(created.attempts(), 3);
    let outcomes: Vec<_> = created.log.iter().map(|a| a.outcome.as_str()).collect();
    assert_eq!(
        outcomes,
        [
            "Unavailable/PAYMENT_PROVIDER_UNAVAILABLE",
            "Unavailable/PAYMENT_PROVIDER_UNAVAILABLE",
            "OK"
        ]
    );
    assert!(!created.replayed);
    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(app.key_count().await, 1, "every attempt sent the one key");
    // The retries said they resend the key (`idempotency-key-resent`) and found it by a read.
    let sent = app.claim_statements_sent();
    assert_eq!(sent.reads, 2, "{sent:?}");
    let row = app.key_row(&user, &created.key).await.unwrap();
    assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(
        app.rides().await[0].stripe_charge_id.as_deref(),
        Some(created.ride.charge_id.as_str())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_declined_card_stops_at_the_first_answer() {
    let app = TestApp::spawn().await;
    let user = app.create_user(DECLINED_CARD).await;

    let error = client(&app, &user)
        .await
        .create_ride(ride_request())
        .await
        .unwrap_err();

    assert_eq!(error.attempts(), 1);
    assert!(
        matches!(&error.error, RidesError::CardDeclined { decline_code: Some(_), status } if status.code() == tonic::Code::FailedPrecondition),
        "{error:?}"
    );
    assert!(!error.error.is_retryable());
    assert_eq!(error.log[0].wait, None);
    assert!(error.key.is_some());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reused_key_is_refused_without_retry_and_a_replay_is_marked() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let client = client(&app, &user).await;
    let key = new_key();
    let first = client
        .create_ride_with_key(key.clone(), ride_request())
        .await
        .unwrap();

    let error = client
        .create_ride_with_key(key.clone(), other_ride())
        .await
        .unwrap_err();
    assert!(
        matches!(error.error, RidesError::IdempotencyKeyReused(_)),
        "{error:?}"
    );
    assert_eq!(error.attempts(), 1);
    assert_eq!(error.key.as_deref(), Some(key.as_str()));

    let replay = client
        .create_ride_with_key(key.clone(), ride_request())
        .await
        .unwrap();
    assert!(replay.replayed);
    assert!(!first.replayed);
    assert_eq!(replay.ride, first.ride);
    assert!(replay.expires_at.is_some());
    assert_eq!(app.stripe.succeeded_charges(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn retry_info_is_the_least_wait() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    // An attempt that holds the key's lock: the server answers IDEMPOTENCY_KEY_IN_USE with
    // RetryInfo until the lock is released (here: aged past the lock timeout).
    let params = api_server::rides::RideParams::new(
        ride_request().origin_lat,
        ride_request().origin_lon,
        ride_request().target_lat,
        ride_request().target_lon,
    )
    .unwrap();
    app.claim(&user, &key, &params).await;
    let key_id = app.key_row(&user, &key).await.unwrap().id;
    let first_answer = Arc::new(tokio::sync::Notify::new());
    let notify = Arc::clone(&first_answer);
    // Not waiting for the holder: its RetryInfo (1 s) is what is tested here.
    let policy = RetryPolicy {
        idempotency_wait: Some(Duration::ZERO),
        ..RetryPolicy::default()
    };
    let client = client(&app, &user)
        .await
        .with_policy(policy)
        .on_attempt(Arc::new(move |_: &AttemptRecord| notify.notify_one()));

    let (created, ()) = tokio::join!(
        client.create_ride_with_key(key.clone(), ride_request()),
        async {
            first_answer.notified().await;
            app.expire_lock(key_id).await;
        }
    );

    let created = created.unwrap();
    let in_use: Vec<_> = created
        .log
        .iter()
        .filter(|a| a.outcome == "Aborted/IDEMPOTENCY_KEY_IN_USE")
        .collect();
    assert!(!in_use.is_empty(), "{:?}", created.log);
    for attempt in &in_use {
        let hint = attempt.retry_info.expect("IN_USE carries RetryInfo");
        assert!(hint >= Duration::from_secs(1));
        assert!(attempt.wait.unwrap() >= hint, "{attempt:?}");
    }
    assert_eq!(created.log.last().unwrap().outcome, "OK");
    assert_eq!(app.stripe.succeeded_charges(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_generated_key_is_kept_across_retries_and_new_per_request() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let client = client(&app, &user).await;
    app.stripe.inject_faults(FaultMode::Error500, 1);

    let first = client.create_ride(ride_request()).await.unwrap();
    let second = client.create_ride(ride_request()).await.unwrap();

    assert_eq!(first.attempts(), 2);
    assert_eq!(second.attempts(), 1);
    assert_ne!(first.key, second.key);
    // One key row per logical request: the retry resumed the first one.
    assert_eq!(app.key_count().await, 2);
    for created in [&first, &second] {
        let row = app.key_row(&user, &created.key).await.unwrap();
        assert_eq!(row.recovery_point, RecoveryPoint::Finished);
    }
    assert_ne!(first.ride.id, second.ride.id);
    assert_eq!(app.stripe.succeeded_charges(), 2);
}

/// A CreateRide with one provider fault injected and an overall deadline of `deadline`: its
/// error, and the number of successful charges afterwards.
async fn with_deadline(fault: FaultMode, deadline: Duration) -> (CallError, usize) {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    app.stripe.inject_faults(fault, 1);
    let policy = RetryPolicy {
        deadline,
        ..RetryPolicy::default()
    };
    let error = client(&app, &user)
        .await
        .with_policy(policy)
        .create_ride(ride_request())
        .await
        .unwrap_err();
    (error, app.stripe.succeeded_charges())
}

/// The error a deadline ended a call with, and the last attempt's error inside it.
fn last_before_deadline(error: &CallError) -> &RidesError {
    match &error.error {
        RidesError::DeadlineExceeded {
            last: Some(last), ..
        } => last,
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_deadline_bounds_an_attempt_the_provider_never_answers() {
    // The server waits up to STRIPE_TIMEOUT_MS (2 s) for the provider; the deadline is shorter.
    let (error, _) = with_deadline(FaultMode::Timeout, Duration::from_millis(500)).await;

    // The attempt was cut at the deadline, and no retry was started after it.
    assert!(
        matches!(last_before_deadline(&error), RidesError::AttemptTimedOut(_)),
        "{error:?}"
    );
    assert_eq!(error.attempts(), 1);
    assert_eq!(error.log[0].outcome, "CLIENT/TIMEOUT");
    assert_eq!(error.log[0].wait, None);
    assert!(error.error.is_retryable(), "the key stays resumable");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wait_that_would_pass_the_deadline_is_not_started() {
    // The provider error asks for 2 s; the deadline leaves less.
    let (error, charges) = with_deadline(FaultMode::Error500, Duration::from_millis(1500)).await;

    assert_eq!(error.attempts(), 1);
    assert!(
        matches!(
            last_before_deadline(&error),
            RidesError::PaymentProviderUnavailable(_)
        ),
        "{error:?}"
    );
    assert_eq!(error.log[0].retry_info, Some(Duration::from_secs(2)));
    assert_eq!(error.log[0].wait, None);
    assert_eq!(charges, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn transport_failures_are_retried_with_the_same_key() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&seen);
    let policy = RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(1),
        ..RetryPolicy::default()
    };
    let client = RidesClient::connect_lazy(&url, &ClientTls::default(), Credential::user("t"))
        .unwrap()
        .with_policy(policy)
        .on_attempt(Arc::new(move |a: &AttemptRecord| {
            sink.lock().unwrap().push(a.clone());
        }));

    let error = client.create_ride(ride_request()).await.unwrap_err();

    assert!(matches!(error.error, RidesError::Transport(_)), "{error:?}");
    assert!(error.error.is_retryable());
    assert_eq!(error.attempts(), 3);
    assert_eq!(
        *seen.lock().unwrap(),
        error.log,
        "the observer saw every attempt"
    );
    assert!(error.log.iter().all(|a| a.outcome == "Unavailable/-"));
    assert!(error.log[..2].iter().all(|a| a.wait.is_some()));
}

#[tokio::test(flavor = "multi_thread")]
async fn get_ride_and_the_internal_credential() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let as_user = client(&app, &user).await;
    let internal = as_user
        .clone()
        .with_credential(Credential::internal(INTERNAL_API_TOKEN, user.id));

    // The completer's way: CreateRide on behalf of the user, only for a key the user created.
    let key = new_key();
    let refused = internal
        .create_ride_with_key(key.clone(), ride_request())
        .await
        .unwrap_err();
    assert!(
        matches!(refused.error, RidesError::InternalCredentialNotAllowed(_)),
        "{refused:?}"
    );
    assert_eq!(refused.attempts(), 1, "final: not retried");
    as_user
        .create_ride_with_key(key.clone(), ride_request())
        .await
        .unwrap();
    let created = internal
        .create_ride_with_key(key, ride_request())
        .await
        .unwrap();
    let fetched = as_user.get_ride(created.ride.id).await.unwrap();
    assert_eq!(fetched.ride, created.ride);
    assert_eq!(fetched.log.len(), 1);

    let refused = internal.get_ride(created.ride.id).await.unwrap_err();
    assert!(
        matches!(refused.error, RidesError::InternalCredentialNotAllowed(_)),
        "{refused:?}"
    );
    let missing = as_user.get_ride(created.ride.id + 1000).await.unwrap_err();
    assert!(
        matches!(missing.error, RidesError::RideNotFound(_)),
        "{missing:?}"
    );
    assert_eq!(missing.attempts(), 1);
    let nobody = as_user
        .with_credential(Credential::user(format!("rr_{}", "A".repeat(43))))
        .create_ride(ride_request())
        .await
        .unwrap_err();
    assert!(
        matches!(nobody.error, RidesError::InvalidCredentials(_)),
        "{nobody:?}"
    );
    assert_eq!(nobody.attempts(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn mutual_tls() {
    let server_ca = TestCa::new("server ca");
    let client_ca = TestCa::new("client ca");
    let files = TlsFiles::new(&server_ca, Some(&client_ca));
    let env = files.env();
    let overrides: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let app = TestApp::spawn_with(fake_stripe::Config::default(), &overrides).await;
    let user = app.create_user(GOOD_CARD).await;
    let (cert, key) = client_ca.issue("rides-client test");
    let write = |name: &str, contents: &str| {
        let path = files.dir.join(name);
        std::fs::write(&path, contents).unwrap();
        Some(path)
    };
    let tls = ClientTls {
        ca: write("trusts.pem", &server_ca.cert_pem),
        cert: write("client.pem", &cert),
        key: write("client.key", &key),
    };
    let url = format!("https://{}", app.addr);

    let created = RidesClient::connect_lazy(&url, &tls, Credential::user(&user.token))
        .unwrap()
        .create_ride(ride_request())
        .await
        .unwrap();
    assert_eq!(created.attempts(), 1);

    // Without a client certificate the handshake fails: a transport error, retried, never OK.
    let anonymous = ClientTls {
        cert: None,
        key: None,
        ..tls
    };
    let policy = RetryPolicy {
        max_attempts: 2,
        initial_backoff: Duration::from_millis(1),
        ..RetryPolicy::default()
    };
    let error = RidesClient::connect_lazy(&url, &anonymous, Credential::user(&user.token))
        .unwrap()
        .with_policy(policy)
        .create_ride(ride_request())
        .await
        .unwrap_err();
    assert!(error.error.is_retryable(), "{error:?}");
    assert_eq!(app.stripe.succeeded_charges(), 1);
}

/// A client whose attempts give up after 700 ms, against a provider that takes 1.5 s: every
/// retry finds the first attempt still running.
async fn impatient_against_a_slow_provider(
    idempotency_wait: Option<Duration>,
) -> (TestApp, Result<rides_client::Created, CallError>) {
    let app = TestApp::spawn_with(
        fake_stripe::Config {
            latency: Duration::from_millis(1500),
            ..Default::default()
        },
        &[],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let policy = RetryPolicy {
        max_attempts: 6,
        initial_backoff: Duration::from_millis(1),
        attempt_timeout: Duration::from_millis(700),
        idempotency_wait,
        ..RetryPolicy::default()
    };
    let result = client(&app, &user)
        .await
        .with_policy(policy)
        .create_ride(ride_request())
        .await;
    (app, result)
}

#[tokio::test(flavor = "multi_thread")]
async fn by_default_a_retry_waits_for_the_attempt_it_gave_up_on_and_gets_its_answer() {
    let (app, created) = impatient_against_a_slow_provider(None).await;
    let created = created.unwrap();

    assert_eq!(created.log[0].outcome, "CLIENT/TIMEOUT");
    assert!(created.replayed, "the first attempt's answer, replayed");
    // Any `IDEMPOTENCY_KEY_IN_USE` came after a wait (its retry may come at once), none at once.
    for attempt in &created.log[1..created.log.len() - 1] {
        assert_eq!(attempt.outcome, "Aborted/IDEMPOTENCY_KEY_IN_USE");
        assert_eq!(attempt.retry_info, Some(Duration::ZERO));
    }
    assert_eq!(app.stripe.create_calls(), 1);
    assert_eq!(app.stripe.succeeded_charges(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_opts_out_of_waiting_gets_in_use_and_backs_off() {
    let (app, created) = impatient_against_a_slow_provider(Some(Duration::ZERO)).await;
    let created = created.unwrap();

    assert_eq!(created.log[0].outcome, "CLIENT/TIMEOUT");
    assert_eq!(created.log[1].outcome, "Aborted/IDEMPOTENCY_KEY_IN_USE");
    assert_eq!(created.log[1].retry_info, Some(Duration::from_secs(1)));
    assert!(created.replayed);
    assert_eq!(app.stripe.succeeded_charges(), 1);
}
