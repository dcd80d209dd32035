//! Requests refused before anything is written: missing credentials, a bad key, each invalid
//! parameter by name, and a key reused with other parameters (with the coordinates jsonb could
//! round, which are a replay, not a reuse).

use api_server::{grpc::reason, testing::*};
use proto::v1::CreateRideRequest;
use tonic::Code;
use tonic_types::StatusExt;

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
    let cases = invalid_parameters();
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

/// Valid requests but for one coordinate (missing, not finite, or out of range), each with the
/// field that must be named.
fn invalid_parameters() -> Vec<(&'static str, CreateRideRequest)> {
    let valid = ride_request();
    let with = |change: fn(&mut CreateRideRequest)| {
        let mut request = valid;
        change(&mut request);
        request
    };
    vec![
        ("origin_lat", with(|r| r.origin_lat = None)),
        ("origin_lon", with(|r| r.origin_lon = None)),
        ("target_lat", with(|r| r.target_lat = None)),
        ("target_lon", with(|r| r.target_lon = None)),
        ("origin_lat", with(|r| r.origin_lat = Some(f64::NAN))),
        ("origin_lon", with(|r| r.origin_lon = Some(f64::INFINITY))),
        (
            "target_lat",
            with(|r| r.target_lat = Some(f64::NEG_INFINITY)),
        ),
        ("origin_lat", with(|r| r.origin_lat = Some(90.0001))),
        ("target_lat", with(|r| r.target_lat = Some(-91.0))),
        ("origin_lon", with(|r| r.origin_lon = Some(180.5))),
        ("target_lon", with(|r| r.target_lon = Some(-181.0))),
    ]
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
