//! What a CreateRide asks for: the validated ride parameters, and the request signature a key is
//! bound to (a retry must present the same).

use contract::StoredRideRequest;
use serde::{Deserialize, Serialize};

use crate::idempotency::RequestSignature;

pub const CREATE_RIDE_METHOD: &str = "POST";
pub const CREATE_RIDE_PATH: &str = "/rides.v1.RideService/CreateRide";
/// A ride request whose coordinates are finite and in range.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RideParams {
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
}

/// One field that failed validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldViolation {
    pub field: &'static str,
    pub description: String,
}

impl RideParams {
    /// Validates raw coordinates, reporting every bad field at once.
    pub fn new(
        origin_lat: Option<f64>,
        origin_lon: Option<f64>,
        target_lat: Option<f64>,
        target_lon: Option<f64>,
    ) -> Result<RideParams, Vec<FieldViolation>> {
        let mut violations = Vec::new();
        let mut check = |field: &'static str, value: Option<f64>, limit: f64| match value {
            None => {
                violations.push(FieldViolation {
                    field,
                    description: format!("{field} is required"),
                });
                0.0
            }
            Some(value) if !value.is_finite() => {
                violations.push(FieldViolation {
                    field,
                    description: format!("{field} must be a finite number"),
                });
                0.0
            }
            Some(value) if !(-limit..=limit).contains(&value) => {
                violations.push(FieldViolation {
                    field,
                    description: format!("{field} must be between -{limit} and {limit}"),
                });
                0.0
            }
            // -0.0 and 0.0 are the same place; storing one spelling keeps retries comparable.
            Some(value) => value + 0.0,
        };
        let params = RideParams {
            origin_lat: check("origin_lat", origin_lat, 90.0),
            origin_lon: check("origin_lon", origin_lon, 180.0),
            target_lat: check("target_lat", target_lat, 90.0),
            target_lon: check("target_lon", target_lon, 180.0),
        };
        if violations.is_empty() {
            Ok(params)
        } else {
            Err(violations)
        }
    }

    /// What the key is bound to: a retry must present the same.
    pub fn signature(&self) -> RequestSignature {
        RequestSignature {
            method: CREATE_RIDE_METHOD,
            path: CREATE_RIDE_PATH,
            params: self.stored().to_stored(),
        }
    }

    /// The parameters as the key stores them (`contract::StoredRideRequest`).
    pub fn stored(&self) -> StoredRideRequest {
        StoredRideRequest {
            origin_lat: self.origin_lat,
            origin_lon: self.origin_lon,
            target_lat: self.target_lat,
            target_lon: self.target_lon,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_every_bad_field() {
        let violations =
            RideParams::new(None, Some(f64::NAN), Some(90.5), Some(-180.0)).unwrap_err();
        let fields: Vec<_> = violations.iter().map(|v| v.field).collect();
        assert_eq!(fields, ["origin_lat", "origin_lon", "target_lat"]);
        assert!(RideParams::new(Some(f64::INFINITY), Some(0.0), Some(0.0), Some(0.0)).is_err());
        assert!(RideParams::new(Some(-90.0), Some(180.0), Some(90.0), Some(-180.0)).is_ok());
    }

    #[test]
    fn negative_zero_is_stored_as_zero() {
        let params = RideParams::new(Some(-0.0), Some(0.0), Some(1.0), Some(1.0)).unwrap();
        assert!(params.origin_lat.is_sign_positive());
    }
}
