//! The final outcome of a CreateRide, stored on its finished key and replayed from there. Fresh
//! answers are built from the same stored value, so a replay is identical to the original.

use chrono::{DateTime, Utc};
use schema::{JsonText, models::Ride};
use serde::{Deserialize, Serialize};

/// The message of every successful CreateRide (and of its replays).
pub const PAYMENT_ACCEPTED: &str = "Payment accepted. Your pilot is on their way!";

/// The message of a key whose charge was refunded (and of its replays).
pub const PAYMENT_REFUNDED: &str = "The payment for this ride was refunded; this request will not \
     be charged again. Book again with a new idempotency key.";

/// Stored response codes are gRPC status codes, because the stored outcome is replayed as the
/// same gRPC answer.
pub const CODE_OK: i32 = 0;
pub const CODE_FAILED_PRECONDITION: i32 = 9;

/// A final outcome as `idempotency_keys` stores it (`response_code`, `response_body`). The body
/// stays JSON text from the row to [`Outcome::from_stored`] and from [`Outcome::to_stored`] to the
/// row ([`JsonText`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StoredResponse {
    pub code: i32,
    pub body: JsonText,
}

/// The stored outcome of a finished key does not decode: a replay cannot be answered.
#[derive(Debug, thiserror::Error)]
#[error("the stored outcome of a finished key is unreadable")]
pub struct CorruptStoredResponse;

impl From<CorruptStoredResponse> for schema::store::StoreError {
    fn from(_: CorruptStoredResponse) -> schema::store::StoreError {
        schema::store::StoreError::CorruptStoredResponse
    }
}

/// A ride as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RideView {
    pub id: i64,
    pub origin_lat: f64,
    pub origin_lon: f64,
    pub target_lat: f64,
    pub target_lon: f64,
    pub charge_id: Option<String>,
    pub amount: i64,
    pub currency: String,
    pub created_at: DateTime<Utc>,
}

impl From<Ride> for RideView {
    fn from(ride: Ride) -> RideView {
        RideView {
            id: ride.id,
            origin_lat: ride.origin_lat,
            origin_lon: ride.origin_lon,
            target_lat: ride.target_lat,
            target_lon: ride.target_lon,
            charge_id: ride.stripe_charge_id,
            amount: ride.amount,
            currency: ride.currency,
            created_at: ride.created_at,
        }
    }
}

/// A final outcome: stored on the key by the phase that reaches it (or by an operator), and
/// replayed from there. Read through [`StoredFields`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case", try_from = "StoredFields")]
pub enum Outcome {
    RideCreated {
        ride: RideView,
        message: String,
    },
    CardDeclined {
        message: String,
        decline_code: Option<String>,
    },
    /// The key's charge was made but never recorded, and was then refunded (the reconciler's
    /// `unrecorded_charge`, `workers::reconciler::refund`), in the same transaction that stored
    /// this: the key is final, so a retry replays this instead of recording the refunded charge as
    /// the ride's payment.
    PaymentRefunded {
        ride_id: Option<i64>,
        payment_intent: String,
        refund_id: String,
        message: String,
    },
}

/// The stored form's fields, every kind's together. serde reads an internally tagged enum by
/// first copying the whole object into a buffer of its own (PostgreSQL hands the tag back after
/// `message`), which cost a replay more than reading the rest of its row; a plain struct is read
/// in one pass. Unknown fields are ignored, as the tagged enum ignores them.
#[derive(Deserialize)]
struct StoredFields {
    outcome: OutcomeKind,
    message: String,
    ride: Option<RideView>,
    decline_code: Option<String>,
    ride_id: Option<i64>,
    payment_intent: Option<String>,
    refund_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum OutcomeKind {
    RideCreated,
    CardDeclined,
    PaymentRefunded,
}

impl TryFrom<StoredFields> for Outcome {
    type Error = &'static str;

    fn try_from(fields: StoredFields) -> Result<Outcome, &'static str> {
        let StoredFields {
            outcome,
            message,
            ride,
            decline_code,
            ride_id,
            payment_intent,
            refund_id,
        } = fields;
        Ok(match outcome {
            OutcomeKind::RideCreated => Outcome::RideCreated {
                ride: ride.ok_or("a created ride's outcome has no ride")?,
                message,
            },
            OutcomeKind::CardDeclined => Outcome::CardDeclined {
                message,
                decline_code,
            },
            OutcomeKind::PaymentRefunded => Outcome::PaymentRefunded {
                ride_id,
                payment_intent: payment_intent.ok_or("a refund's outcome has no payment intent")?,
                refund_id: refund_id.ok_or("a refund's outcome has no refund id")?,
                message,
            },
        })
    }
}

impl Outcome {
    /// A paid ride, with the message every success answers.
    pub fn ride_created(ride: Ride) -> Outcome {
        Outcome::RideCreated {
            ride: RideView::from(ride),
            message: PAYMENT_ACCEPTED.to_owned(),
        }
    }

    /// The stored form (response code and body) that a replay is rebuilt from.
    pub fn to_stored(&self) -> StoredResponse {
        let code = match self {
            Outcome::RideCreated { .. } => CODE_OK,
            Outcome::CardDeclined { .. } | Outcome::PaymentRefunded { .. } => {
                CODE_FAILED_PRECONDITION
            }
        };
        // Plain fields only: serialising cannot fail.
        let body = JsonText::of(self).unwrap_or_else(|_| JsonText::null());
        StoredResponse { code, body }
    }

    pub fn from_stored(stored: &StoredResponse) -> Result<Outcome, CorruptStoredResponse> {
        stored.body.parse().map_err(|_| CorruptStoredResponse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_round_trip_through_storage() {
        let outcome = Outcome::CardDeclined {
            message: "Your card was declined.".into(),
            decline_code: Some("generic_decline".into()),
        };
        let stored = outcome.to_stored();
        assert_eq!(stored.code, CODE_FAILED_PRECONDITION);
        assert_eq!(Outcome::from_stored(&stored).unwrap(), outcome);
        let garbage = StoredResponse {
            code: CODE_OK,
            body: serde_json::json!({"outcome": "teleported"}).into(),
        };
        assert!(Outcome::from_stored(&garbage).is_err());
        let refunded = Outcome::PaymentRefunded {
            ride_id: Some(3),
            payment_intent: "pi_1".into(),
            refund_id: "re_1".into(),
            message: PAYMENT_REFUNDED.into(),
        };
        let stored = refunded.to_stored();
        assert_eq!(stored.code, CODE_FAILED_PRECONDITION);
        assert_eq!(stored.body.to_value()["outcome"], "payment_refunded");
        assert_eq!(Outcome::from_stored(&stored).unwrap(), refunded);
    }

    #[test]
    fn stored_outcomes_read_back_as_postgresql_spells_them() {
        // jsonb orders keys by length, then bytewise: the tag comes after `message`.
        let body = r#"{"ride": {"id": 7, "amount": 2000, "currency": "usd", "charge_id": "pi_1",
            "origin_lat": 1.5, "origin_lon": 2.5, "target_lat": 3.5, "target_lon": 4.5,
            "created_at": "2026-11-29T10:00:00Z"}, "message": "ok", "outcome": "ride_created",
            "extra": true}"#;
        let stored = |body: &str| StoredResponse {
            code: CODE_OK,
            body: serde_json::from_str::<serde_json::Value>(body)
                .unwrap()
                .into(),
        };
        let Outcome::RideCreated { ride, message } = Outcome::from_stored(&stored(body)).unwrap()
        else {
            panic!("a created ride");
        };
        assert_eq!(
            (ride.id, ride.charge_id.as_deref(), message.as_str()),
            (7, Some("pi_1"), "ok")
        );
        for missing in [
            r#"{"message": "ok", "outcome": "ride_created"}"#,
            r#"{"message": "m", "outcome": "payment_refunded", "refund_id": "re_1"}"#,
            r#"{"outcome": "card_declined"}"#,
        ] {
            assert!(Outcome::from_stored(&stored(missing)).is_err(), "{missing}");
        }
        let declined = r#"{"message": "no", "outcome": "card_declined"}"#;
        assert_eq!(
            Outcome::from_stored(&stored(declined)).unwrap(),
            Outcome::CardDeclined {
                message: "no".into(),
                decline_code: None
            }
        );
    }
}
