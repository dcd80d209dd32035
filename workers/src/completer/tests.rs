//! The completer's unit tests: how an attempt's result is classified, and the CreateRide request
//! rebuilt from a key's stored parameters. The passes against a real database are the fleet's tests
//! (tests/fleet/completer.rs).

use tonic_types::StatusExt;

use super::*;

#[test]
fn classifies_outcomes() {
    let with_reason = |code: Code, reason: &str| {
        Err(CallError {
            method: "CreateRide",
            key: Some("k".repeat(20)),
            log: Vec::new(),
            error: RidesError::from(tonic::Status::with_error_details(
                code,
                "x",
                tonic_types::ErrorDetails::with_error_info(
                    reason,
                    proto::reason::ERROR_DOMAIN,
                    std::collections::HashMap::<String, String>::new(),
                ),
            )),
        })
    };
    let created = Created {
        ride: proto::v1::Ride::default(),
        message: String::new(),
        key: "k".repeat(20),
        replayed: false,
        expires_at: None,
        log: Vec::new(),
    };
    assert_eq!(classify(&Ok(created)), Attempt::Completed);
    assert_eq!(
        classify(&with_reason(Code::FailedPrecondition, "CARD_DECLINED")),
        Attempt::Declined
    );
    assert_eq!(
        classify(&with_reason(Code::Aborted, "IDEMPOTENCY_KEY_IN_USE")),
        Attempt::InUse
    );
    assert!(matches!(
        classify(&with_reason(
            Code::Unavailable,
            "PAYMENT_PROVIDER_UNAVAILABLE"
        )),
        Attempt::StillFailing(_)
    ));
    assert!(matches!(
        classify(&with_reason(Code::Aborted, "IDEMPOTENCY_KEY_LOCK_LOST")),
        Attempt::StillFailing(_)
    ));
    let internal = Err(CallError {
        method: "CreateRide",
        key: None,
        log: Vec::new(),
        error: RidesError::from(tonic::Status::internal("boom")),
    });
    assert!(matches!(classify(&internal), Attempt::StillFailing(_)));
    // Neither a rate limit nor an unreachable server is the key's failure.
    let unreachable = Err(CallError {
        method: "CreateRide",
        key: None,
        log: Vec::new(),
        error: RidesError::from(tonic::Status::unavailable("connection refused")),
    });
    assert_eq!(classify(&unreachable), Attempt::Deferred(None));
    assert!(matches!(
        classify(&with_reason(Code::ResourceExhausted, "RATE_LIMITED")),
        Attempt::Deferred(_)
    ));
    assert_eq!(
        classify(&with_reason(Code::Unauthenticated, "INVALID_CREDENTIALS")),
        Attempt::CredentialRefused(Code::Unauthenticated)
    );
}

#[test]
fn rebuilds_requests() {
    let request = request_from_params(&serde_json::json!({
        "origin_lat": 1.5, "origin_lon": 2.0, "target_lat": -3.0, "target_lon": 4.25
    }))
    .unwrap();
    assert_eq!(request.origin_lat, Some(1.5));
    assert_eq!(request.target_lon, Some(4.25));
    assert!(request_from_params(&serde_json::json!([1])).is_none());
    let missing = serde_json::json!({"origin_lat": 1.5, "origin_lon": 2.0, "target_lat": -3.0});
    assert!(request_from_params(&missing).is_none());
}
