//! `proto/service_config.json` is what callers in other languages load (docs/errors.md, "Calling from
//! other languages"): it must parse, name both methods, retry exactly `UNAVAILABLE` and `ABORTED`,
//! and carry the numbers of the Rust client's default policy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use rides_client::RetryPolicy;
use serde_json::Value;

const CONFIG: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../proto/service_config.json"
));

/// A protobuf JSON `Duration` ("0.1s", "5s").
fn duration(value: &Value) -> Duration {
    let text = value.as_str().unwrap();
    Duration::from_secs_f64(text.strip_suffix('s').unwrap().parse().unwrap())
}

#[test]
fn the_service_config_matches_the_default_policy() {
    let config: Value = serde_json::from_str(CONFIG).unwrap();
    let methods = config["methodConfig"].as_array().unwrap();
    assert_eq!(methods.len(), 1);
    let method = &methods[0];
    let names: Vec<(&str, &str)> = method["name"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["service"].as_str().unwrap(),
                n["method"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("rides.v1.RideService", "CreateRide"),
            ("rides.v1.RideService", "GetRide")
        ]
    );
    let policy = RetryPolicy::default();
    let retry = &method["retryPolicy"];
    assert_eq!(duration(&method["timeout"]), policy.deadline);
    assert_eq!(
        retry["maxAttempts"].as_u64().unwrap(),
        u64::from(policy.max_attempts)
    );
    assert_eq!(duration(&retry["initialBackoff"]), policy.initial_backoff);
    assert_eq!(duration(&retry["maxBackoff"]), policy.max_backoff);
    assert_eq!(
        retry["backoffMultiplier"].as_f64().unwrap(),
        policy.multiplier
    );
    assert_eq!(
        retry["retryableStatusCodes"],
        serde_json::json!(["UNAVAILABLE", "ABORTED"])
    );
    // gRPC clamps maxAttempts to 5: a larger default would silently differ between languages.
    assert!(policy.max_attempts <= 5);
}
