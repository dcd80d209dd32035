//! The versioned message contract on the `rides` exchange. Other teams consume these, so the
//! shape only changes additively within a version; anything else is a new `version`.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::jobs::ReceiptJob;

pub const RECEIPT_MESSAGE_TYPE: &str = "ride.receipt";
pub const RECEIPT_MESSAGE_VERSION: u32 = 1;

/// `ride.receipt` version 1: a paid ride whose rider should get a receipt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReceiptMessage {
    pub version: u32,
    #[serde(rename = "type")]
    pub kind: String,
    pub ride_id: i64,
    pub user_id: i64,
    /// The provider's charge (PaymentIntent) id.
    pub charge_id: String,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// Lower-case ISO 4217.
    pub currency: String,
    /// When the ride was created.
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("the message is not a JSON object: {0}")]
    Malformed(String),
    #[error("the message has no numeric version")]
    MissingVersion,
    #[error("unsupported message version {0}")]
    UnsupportedVersion(u64),
    #[error("unexpected message type {0:?}")]
    WrongType(String),
    #[error("invalid receipt message: {0}")]
    Invalid(String),
}

impl ReceiptMessage {
    /// The message for a staged receipt job; `None` for args without a charge.
    pub fn from_job(args: ReceiptJob) -> Option<ReceiptMessage> {
        Some(ReceiptMessage {
            version: RECEIPT_MESSAGE_VERSION,
            kind: RECEIPT_MESSAGE_TYPE.to_owned(),
            ride_id: args.ride_id,
            user_id: args.user_id,
            charge_id: args.charge_id?,
            amount: args.amount,
            currency: args.currency,
            created_at: args.created_at,
        })
    }

    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    /// Decodes a message body. Unknown versions and types are errors, never guesses; unknown
    /// extra fields are ignored so that producers can add fields within a version.
    pub fn decode(body: &[u8]) -> Result<ReceiptMessage, DecodeError> {
        let value: serde_json::Value = serde_json::from_slice(body)
            .map_err(|error| DecodeError::Malformed(error.to_string()))?;
        let object = value
            .as_object()
            .ok_or_else(|| DecodeError::Malformed("not an object".into()))?;
        let version = object
            .get("version")
            .and_then(serde_json::Value::as_u64)
            .ok_or(DecodeError::MissingVersion)?;
        if version != u64::from(RECEIPT_MESSAGE_VERSION) {
            return Err(DecodeError::UnsupportedVersion(version));
        }
        let kind = object.get("type").and_then(serde_json::Value::as_str);
        if kind != Some(RECEIPT_MESSAGE_TYPE) {
            return Err(DecodeError::WrongType(kind.unwrap_or_default().to_owned()));
        }
        let message: ReceiptMessage = serde_json::from_value(value)
            .map_err(|error| DecodeError::Invalid(error.to_string()))?;
        if message.ride_id <= 0 || message.user_id <= 0 || message.amount <= 0 {
            return Err(DecodeError::Invalid(
                "ride_id, user_id and amount must be positive".into(),
            ));
        }
        Ok(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> serde_json::Value {
        serde_json::json!({
            "version": 1, "type": "ride.receipt", "ride_id": 7, "user_id": 3,
            "charge_id": "pi_123", "amount": 2000, "currency": "usd",
            "created_at": "2026-11-21T09:00:00Z"
        })
    }

    #[test]
    fn round_trips() {
        let message = ReceiptMessage::decode(sample().to_string().as_bytes()).unwrap();
        assert_eq!(message.ride_id, 7);
        let again = ReceiptMessage::decode(&message.encode().unwrap()).unwrap();
        assert_eq!(again, message);
    }

    #[test]
    fn ignores_added_fields() {
        let mut value = sample();
        value["pilot"] = serde_json::json!("Ada");
        assert!(ReceiptMessage::decode(value.to_string().as_bytes()).is_ok());
    }

    #[test]
    fn rejects_bad_input_without_panicking() {
        let mut v2 = sample();
        v2["version"] = serde_json::json!(2);
        let mut no_version = sample();
        no_version.as_object_mut().unwrap().remove("version");
        let mut wrong_type = sample();
        wrong_type["type"] = serde_json::json!("ride.refund");
        let mut missing = sample();
        missing.as_object_mut().unwrap().remove("charge_id");
        let mut negative = sample();
        negative["amount"] = serde_json::json!(-5);
        for body in [
            b"not json".to_vec(),
            b"[1,2]".to_vec(),
            b"".to_vec(),
            vec![0xff, 0xfe],
            v2.to_string().into_bytes(),
            no_version.to_string().into_bytes(),
            wrong_type.to_string().into_bytes(),
            missing.to_string().into_bytes(),
            negative.to_string().into_bytes(),
        ] {
            assert!(ReceiptMessage::decode(&body).is_err(), "{body:?}");
        }
        assert!(matches!(
            ReceiptMessage::decode(v2.to_string().as_bytes()),
            Err(DecodeError::UnsupportedVersion(2))
        ));
    }
}
