//! Requests into domain values (`TryFrom`, the idempotency key and the bearer token from
//! metadata) and domain results into responses (`into_response`, the one place a CreateRide
//! outcome becomes a gRPC answer).

use proto::v1::{CreateRideRequest, CreateRideResponse, Ride};
use tonic::{
    Response, Status,
    metadata::{MetadataMap, MetadataValue},
};

use contract::{Outcome, RideView};

use crate::{
    auth::{self},
    idempotency::IdempotencyKey,
    rides::{CreateRideReply, FieldViolation, RideParams},
};

use super::*;

impl TryFrom<CreateRideRequest> for RideParams {
    type Error = Vec<FieldViolation>;

    fn try_from(request: CreateRideRequest) -> Result<RideParams, Self::Error> {
        RideParams::new(
            request.origin_lat,
            request.origin_lon,
            request.target_lat,
            request.target_lon,
        )
    }
}

/// A ride as the API message carries it (the view lives in `contract`, the message in `proto`,
/// so this cannot be a `From`).
pub(super) fn ride_message(ride: RideView) -> Ride {
    Ride {
        id: ride.id,
        origin_lat: ride.origin_lat,
        origin_lon: ride.origin_lon,
        target_lat: ride.target_lat,
        target_lon: ride.target_lon,
        charge_id: ride.charge_id.unwrap_or_default(),
        amount: ride.amount,
        currency: ride.currency,
        created_at: Some(prost_types::Timestamp {
            seconds: ride.created_at.timestamp(),
            // Always below 2e9, so the conversion cannot fail.
            nanos: i32::try_from(ride.created_at.timestamp_subsec_nanos()).unwrap_or(0),
        }),
    }
}

/// The validated key from `idempotency-key` metadata, or the `INVALID_IDEMPOTENCY_KEY` status.
///
/// Public only so that the fuzz target `idempotency_key` (in `fuzz/`, outside the workspace) runs
/// exactly what a CreateRide call does with the metadata value.
pub fn idempotency_key(metadata: &MetadataMap) -> Result<IdempotencyKey, Status> {
    let raw = metadata
        .get(IDEMPOTENCY_KEY_HEADER)
        .ok_or_else(|| status::invalid_key("the idempotency-key metadata is required"))?;
    let raw = raw
        .to_str()
        .map_err(|_| status::invalid_key("the idempotency-key must be visible ASCII"))?;
    IdempotencyKey::parse(raw).map_err(|error| status::invalid_key(&error.to_string()))
}

/// Whether the caller says it sent this call's key before (`idempotency-key-resent: true`): a hint
/// that the key most likely exists, so that its claim reads before it writes. It decides no
/// answer, so any other value, or none, is taken for a first send.
pub(super) fn key_resent(metadata: &MetadataMap) -> bool {
    metadata
        .get(proto::metadata::IDEMPOTENCY_KEY_RESENT)
        .is_some_and(|value| value.as_bytes() == b"true")
}

/// Reads a W3C trace context from gRPC metadata.
pub(super) struct MetadataExtractor<'a>(pub(super) &'a MetadataMap);

impl opentelemetry::propagation::Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                tonic::metadata::KeyRef::Ascii(key) => Some(key.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The token of the `authorization: Bearer <token>` metadata.
pub(super) fn bearer(metadata: &MetadataMap) -> Result<&str, Status> {
    metadata
        .get(proto::metadata::AUTHORIZATION)
        .ok_or_else(status::missing_credentials)?
        .to_str()
        .ok()
        .and_then(auth::bearer_token)
        .ok_or_else(status::invalid_credentials)
}

/// The one place a CreateRide result becomes a gRPC answer, for fresh and replayed outcomes alike.
pub(super) fn into_response(
    reply: CreateRideReply,
) -> Result<Response<CreateRideResponse>, Status> {
    let stamp = |metadata: &mut MetadataMap| {
        metadata.insert(
            REPLAYED_HEADER,
            MetadataValue::from_static(if reply.replayed { "true" } else { "false" }),
        );
        if let Some(expires_at) = reply.key_expires_at
            && let Ok(value) = expires_at
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
                .parse()
        {
            metadata.insert(EXPIRES_AT_HEADER, value);
        }
    };
    let result = match reply.result {
        Ok(Outcome::RideCreated { ride, message }) => Ok(CreateRideResponse {
            ride: Some(ride_message(ride)),
            message,
        }),
        Ok(Outcome::CardDeclined {
            message,
            decline_code,
        }) => Err(status::card_declined(&message, decline_code.as_deref())),
        Ok(Outcome::PaymentRefunded { message, .. }) => Err(status::payment_refunded(&message)),
        Err(error) => Err(status::create_ride_error(error)),
    };
    match result {
        Ok(body) => {
            let mut response = Response::new(body);
            stamp(response.metadata_mut());
            Ok(response)
        }
        Err(mut status) => {
            stamp(status.metadata_mut());
            Err(status)
        }
    }
}
