//! CreateRide over real gRPC against a real PostgreSQL and fake-stripe over HTTP: the cases of the
//! Ruby reference's suite, ported, and the ones this service adds. Each test asserts the status,
//! the reason and the database state it leaves.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use api_server::grpc::reason;
use api_server::testing::*;
use fake_stripe::FaultMode;
use proto::v1::CreateRideRequest;
use schema::RecoveryPoint;
use tonic::Code;
use tonic_types::StatusExt;

#[tokio::test(flavor = "multi_thread")]
async fn a_new_key_creates_charges_and_stages_a_receipt() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();

    let response = app.create_ride(&user, &key, ride_request()).await.unwrap();

    assert!(!replayed(&response));
    let key_row = app.key_row(&user, &key).await.unwrap();
    let ttl = chrono::Duration::hours(72);
    assert_eq!(
        expires_at(response.metadata()).timestamp_millis(),
        (key_row.created_at + ttl).timestamp_millis()
    );
    let body = response.into_inner();
    assert_eq!(
        body.message,
        "Payment accepted. Your pilot is on their way!"
    );
    let ride = body.ride.unwrap();
    assert_eq!(ride.origin_lat, 37.7749);
    assert_eq!(ride.target_lon, -121.8863);
    assert_eq!((ride.amount, ride.currency.as_str()), (2000, "usd"));
    assert!(ride.created_at.is_some());

    // The provider holds exactly one succeeded PaymentIntent, and it is the one on the ride.
    let intents = app.stripe.payment_intents();
    assert_eq!(intents.len(), 1);
    assert_eq!(intents[0].status, "succeeded");
    assert_eq!(intents[0].id, ride.charge_id);
    assert_eq!(intents[0].amount, 2000);
    assert_eq!(
        intents[0].metadata.get("ride_id"),
        Some(&ride.id.to_string())
    );

    assert_eq!(key_row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(key_row.response_code, Some(0));
    assert!(key_row.locked_at.is_none() && key_row.lock_token.is_none());

    let rides = app.rides().await;
    assert_eq!(rides.len(), 1);
    assert_eq!(rides[0].id, ride.id);
    assert_eq!(
        rides[0].stripe_charge_id.as_deref(),
        Some(ride.charge_id.as_str())
    );
    assert_eq!(rides[0].idempotency_key_id, Some(key_row.id));

    let audits = app.audit_records().await;
    assert_eq!(audits.len(), 1);
    assert_eq!(audits[0].action, "ride.created");
    assert_eq!(audits[0].resource_id, ride.id);
    assert_eq!(audits[0].origin_ip.addr().to_string(), "127.0.0.1");

    let jobs = app.staged_jobs().await;
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].job_name, "send_ride_receipt");
    assert_eq!(jobs[0].job_args["ride_id"], ride.id);
    assert_eq!(jobs[0].job_args["user_id"], user.id);
    assert_eq!(jobs[0].job_args["amount"], 2000);
    assert_eq!(jobs[0].job_args["currency"], "usd");
    assert_eq!(jobs[0].job_args["charge_id"], ride.charge_id.as_str());
    assert_eq!(
        jobs[0].job_args["created_at"].as_str().map(|at| at
            .parse::<chrono::DateTime<chrono::Utc>>()
            .unwrap()
            .timestamp()),
        Some(ride.created_at.unwrap().seconds)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finished_key_replays_its_success_without_charging_again() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();

    let first = app.create_ride(&user, &key, ride_request()).await.unwrap();
    let second = app.create_ride(&user, &key, ride_request()).await.unwrap();

    assert!(!replayed(&first));
    assert!(replayed(&second));
    assert_eq!(expires_at(first.metadata()), expires_at(second.metadata()));
    assert_eq!(first.into_inner(), second.into_inner());
    assert_eq!(app.stripe.create_calls(), 1);
    assert_eq!(app.rides().await.len(), 1);
    assert_eq!(app.staged_jobs().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_decline_is_final_and_replayed_identically_without_calling_the_provider() {
    let app = TestApp::spawn().await;
    let user = app.create_user(DECLINED_CARD).await;
    let key = new_key();

    let first = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    let second = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();

    assert_status(&first, Code::FailedPrecondition, reason::CARD_DECLINED);
    assert_eq!(first.message(), "Your card was declined.");
    assert_eq!(header(first.metadata(), "idempotent-replayed"), "false");
    assert_eq!(header(second.metadata(), "idempotent-replayed"), "true");
    assert_eq!(
        (second.code(), second.message(), second.details()),
        (first.code(), first.message(), first.details()),
        "a replay must be the same answer, byte for byte"
    );
    let info = first.get_error_details().error_info().cloned().unwrap();
    assert_eq!(
        info.metadata.get("decline_code").map(String::as_str),
        Some("generic_decline")
    );

    assert_eq!(
        app.stripe.create_calls(),
        1,
        "a declined card is never retried"
    );
    assert_eq!(app.stripe.succeeded_charges(), 0);
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::Finished);
    assert_eq!(key_row.response_code, Some(Code::FailedPrecondition as i32));
    // The ride was created before the charge was attempted; it stays, uncharged.
    let rides = app.rides().await;
    assert_eq!(rides.len(), 1);
    assert!(rides[0].stripe_charge_id.is_none());
    assert!(
        app.staged_jobs().await.is_empty(),
        "no receipt for a declined card"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_without_valid_credentials_are_unauthenticated_and_write_nothing() {
    let app = TestApp::spawn().await;
    app.create_user(GOOD_CARD).await;
    let key = new_key();
    let mut client = app.client().await;

    let mut no_auth = tonic::Request::new(ride_request());
    no_auth
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    let status = client.create_ride(no_auth).await.unwrap_err();
    assert_status(&status, Code::Unauthenticated, reason::MISSING_CREDENTIALS);

    for token in ["rr_not-a-real-token", ""] {
        let status = client
            .create_ride(authed(token, Some(&key), ride_request()))
            .await
            .unwrap_err();
        assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);
    }
    let mut basic = tonic::Request::new(ride_request());
    basic
        .metadata_mut()
        .insert("authorization", "Basic dXNlcjpwYXNz".parse().unwrap());
    basic
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    let status = client.create_ride(basic).await.unwrap_err();
    assert_status(&status, Code::Unauthenticated, reason::INVALID_CREDENTIALS);

    app.assert_nothing_written().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_short_long_or_invisible_keys_are_invalid_and_write_nothing() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let mut client = app.client().await;

    let too_long = "k".repeat(256);
    for key in [
        None,
        Some("short-key"),
        Some("k".repeat(19).as_str()),
        Some(too_long.as_str()),
    ] {
        let status = client
            .create_ride(authed(&user.token, key, ride_request()))
            .await
            .unwrap_err();
        assert_status(
            &status,
            Code::InvalidArgument,
            reason::INVALID_IDEMPOTENCY_KEY,
        );
        let details = status.get_error_details();
        let bad_request = details.bad_request().unwrap();
        assert_eq!(bad_request.field_violations[0].field, "idempotency-key");
    }
    let mut spaced = authed(&user.token, None, ride_request());
    spaced.metadata_mut().insert(
        "idempotency-key",
        "has spaces in it 0123456789".parse().unwrap(),
    );
    let status = client.create_ride(spaced).await.unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        reason::INVALID_IDEMPOTENCY_KEY,
    );

    // The boundaries themselves are accepted.
    for key in ["k".repeat(20), "k".repeat(255)] {
        app.create_ride(&user, &key, ride_request()).await.unwrap();
    }
    assert_eq!(app.key_count().await, 2);
    assert_eq!(app.stripe.succeeded_charges(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn each_invalid_parameter_is_named_and_nothing_is_written() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let valid = ride_request();
    let cases: Vec<(&str, CreateRideRequest)> = vec![
        (
            "origin_lat",
            CreateRideRequest {
                origin_lat: None,
                ..valid
            },
        ),
        (
            "origin_lon",
            CreateRideRequest {
                origin_lon: None,
                ..valid
            },
        ),
        (
            "target_lat",
            CreateRideRequest {
                target_lat: None,
                ..valid
            },
        ),
        (
            "target_lon",
            CreateRideRequest {
                target_lon: None,
                ..valid
            },
        ),
        (
            "origin_lat",
            CreateRideRequest {
                origin_lat: Some(f64::NAN),
                ..valid
            },
        ),
        (
            "origin_lon",
            CreateRideRequest {
                origin_lon: Some(f64::INFINITY),
                ..valid
            },
        ),
        (
            "target_lat",
            CreateRideRequest {
                target_lat: Some(f64::NEG_INFINITY),
                ..valid
            },
        ),
        (
            "origin_lat",
            CreateRideRequest {
                origin_lat: Some(90.0001),
                ..valid
            },
        ),
        (
            "target_lat",
            CreateRideRequest {
                target_lat: Some(-91.0),
                ..valid
            },
        ),
        (
            "origin_lon",
            CreateRideRequest {
                origin_lon: Some(180.5),
                ..valid
            },
        ),
        (
            "target_lon",
            CreateRideRequest {
                target_lon: Some(-181.0),
                ..valid
            },
        ),
    ];
    for (field, body) in cases {
        let status = app.create_ride(&user, &new_key(), body).await.unwrap_err();
        assert_status(
            &status,
            Code::InvalidArgument,
            reason::INVALID_RIDE_PARAMETERS,
        );
        let details = status.get_error_details();
        let violations = &details.bad_request().unwrap().field_violations;
        assert_eq!(violations.len(), 1, "{field}: {violations:?}");
        assert_eq!(violations[0].field, field);
    }
    let status = app
        .create_ride(&user, &new_key(), CreateRideRequest::default())
        .await
        .unwrap_err();
    let details = status.get_error_details();
    assert_eq!(details.bad_request().unwrap().field_violations.len(), 4);
    app.assert_nothing_written().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_with_coordinates_that_jsonb_could_round_is_a_replay_not_a_reuse() {
    // 111.84954825293167 came back from JSONB as …168 with serde_json's default float parser,
    // which turned a genuine retry into IDEMPOTENCY_KEY_REUSED.
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    let request = CreateRideRequest {
        origin_lat: Some(-61.3050206078091),
        origin_lon: Some(111.84954825293167),
        target_lat: Some(-47.46480953121321),
        target_lon: Some(-100.17450500404226),
    };
    let first = app.create_ride(&user, &key, request).await.unwrap();
    let retry = app.create_ride(&user, &key, request).await.unwrap();

    assert!(replayed(&retry));
    let ride = retry.into_inner().ride.unwrap();
    assert_eq!(
        ride,
        first.into_inner().ride.unwrap(),
        "the replay is the same ride, bit for bit"
    );
    assert_eq!(ride.origin_lon.to_bits(), 111.84954825293167_f64.to_bits());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_reused_with_other_parameters_is_refused() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.create_ride(&user, &key, ride_request()).await.unwrap();

    let other = CreateRideRequest {
        target_lat: Some(40.0),
        ..ride_request()
    };
    let status = app.create_ride(&user, &key, other).await.unwrap_err();

    assert_status(
        &status,
        Code::FailedPrecondition,
        reason::IDEMPOTENCY_KEY_REUSED,
    );
    assert_eq!(header(status.metadata(), "idempotent-replayed"), "false");
    assert_eq!(app.rides().await.len(), 1);
    assert_eq!(app.stripe.create_calls(), 1);
}

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

#[tokio::test(flavor = "multi_thread")]
async fn provider_errors_leave_the_key_resumable_and_a_retry_charges_once() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::Error500, 1);

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();

    assert_status(
        &status,
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
    );
    assert!(status.get_error_details().retry_info().is_some());
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::RideCreated);
    assert!(
        key_row.locked_at.is_none(),
        "the key is unlocked for an immediate retry"
    );
    assert!(
        key_row.response_code.is_none(),
        "an unavailable provider is not a stored outcome"
    );

    let response = app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert!(!replayed(&response));
    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(app.rides().await.len(), 1);
    assert_eq!(app.staged_jobs().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unexpected_provider_error_is_internal_and_unlocks_the_key() {
    // The provider refuses our API key (HTTP 401): a misconfiguration, not a decline.
    let app = TestApp::spawn_with(
        fake_stripe::Config {
            api_key: Some("sk_test_somebody_else".into()),
            ..Default::default()
        },
        &[],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();

    assert_status(&status, Code::Internal, reason::INTERNAL);
    assert!(
        !status.message().contains("sk_test"),
        "no secret in the answer"
    );
    let key_row = app.key_row(&user, &key).await.unwrap();
    assert_eq!(key_row.recovery_point, RecoveryPoint::RideCreated);
    assert!(key_row.locked_at.is_none() && key_row.lock_token.is_none());
    assert!(key_row.response_code.is_none());
    assert_eq!(app.stripe.succeeded_charges(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_charge_whose_response_was_lost_is_charged_once_in_total() {
    let app = TestApp::spawn().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
    );
    assert_eq!(app.stripe.succeeded_charges(), 1, "the provider did charge");
    assert!(
        app.rides().await[0].stripe_charge_id.is_none(),
        "but we never heard"
    );

    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();
    assert_eq!(
        app.stripe.succeeded_charges(),
        1,
        "the retry reused the provider's key"
    );
    assert_eq!(app.stripe.payment_intents()[0].id, ride.charge_id);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unrecorded_charge_older_than_the_providers_key_window_is_found_not_repeated() {
    let app = TestApp::spawn_with_a_short_provider_key_window().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::ChargeThenDrop, 1);
    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
    );
    assert_eq!(
        app.stripe.succeeded_charges(),
        1,
        "charged, but never recorded"
    );

    // Past the window the provider no longer remembers our key: a blind retry would charge again.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();

    assert_eq!(
        app.stripe.succeeded_charges(),
        1,
        "the earlier charge was found, not repeated"
    );
    assert_eq!(app.stripe.payment_intents()[0].id, ride.charge_id);
    assert_eq!(
        app.stripe.create_calls(),
        1,
        "no second charge was even attempted"
    );
    assert_eq!(app.staged_jobs().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ride_past_the_window_with_no_earlier_charge_is_charged_once() {
    let app = TestApp::spawn_with_a_short_provider_key_window().await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    // The first attempt never reached the provider's charge logic.
    app.fail_at_the_provider(&user, &key).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let ride = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap()
        .into_inner()
        .ride
        .unwrap();

    assert_eq!(app.stripe.succeeded_charges(), 1);
    assert_eq!(app.stripe.payment_intents()[0].id, ride.charge_id);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_provider_timeout_is_unavailable_and_the_retry_charges_once() {
    let app = TestApp::spawn_with(
        fake_stripe::Config::default(),
        &[("STRIPE_TIMEOUT_MS", "300")],
    )
    .await;
    let user = app.create_user(GOOD_CARD).await;
    let key = new_key();
    app.stripe.inject_faults(FaultMode::Timeout, 1);

    let status = app
        .create_ride(&user, &key, ride_request())
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::Unavailable,
        reason::PAYMENT_PROVIDER_UNAVAILABLE,
    );

    app.create_ride(&user, &key, ride_request()).await.unwrap();
    assert_eq!(app.stripe.succeeded_charges(), 1);
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
