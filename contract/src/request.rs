//! The request an idempotency key is bound to, as `idempotency_keys.request_params` stores it: the
//! api-server writes it when it inserts a key and compares every retry against it (a retry must
//! present the same), and the completer reads it back to send the request again. One type, so
//! the writer and the reader cannot drift apart.

use schema::JsonText;
use serde::{Deserialize, Serialize};

/// CreateRide's parameters as stored on its key: the four coordinates, validated (finite, in
/// range, -0.0 written as 0.0) by the api-server before they are stored.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredRideRequest {
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
}

impl StoredRideRequest {
    /// The stored form: a JSON object of the four coordinates.
    pub fn to_stored(self) -> JsonText {
        // Four numbers: serialising cannot fail.
        JsonText::of(&self).unwrap_or_else(|_| JsonText::null())
    }

    /// Reads a stored form back; `None` for anything that is not one (a field missing, another
    /// field, a value that is not a number).
    pub fn from_stored(stored: &serde_json::Value) -> Option<StoredRideRequest> {
        StoredRideRequest::deserialize(stored).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stored_form_reads_back_and_nothing_else_does() {
        let request = StoredRideRequest {
            origin_lat: 37.7749,
            origin_lon: -122.4194,
            target_lat: 0.0,
            target_lon: 4.25,
        };
        let stored = request.to_stored().to_value();
        assert_eq!(
            stored,
            serde_json::json!({
                "origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 0.0, "target_lon": 4.25
            })
        );
        assert_eq!(StoredRideRequest::from_stored(&stored), Some(request));
        for other in [
            serde_json::json!([1]),
            serde_json::json!({"origin_lat": 1.0, "origin_lon": 2.0, "target_lat": 3.0}),
            serde_json::json!({
                "origin_lat": 1.0, "origin_lon": 2.0, "target_lat": 3.0, "target_lon": "4"
            }),
            serde_json::json!({
                "origin_lat": 1.0, "origin_lon": 2.0, "target_lat": 3.0, "target_lon": 4.0,
                "extra": 1
            }),
        ] {
            assert_eq!(StoredRideRequest::from_stored(&other), None, "{other}");
        }
    }
}
