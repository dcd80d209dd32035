//! The jobs staged in `staged_jobs`, written in the business transaction (by the api-server's
//! last phase, or by `workers admin key finish`) and drained by the enqueuer. Each job type is one
//! struct that both builds and parses its `job_args`, so producer and consumer agree by
//! construction (after crates.io's `BackgroundJob`, whose name this trait keeps).
//!
//! Staging has one home, [`BackgroundJob::staged`]: the row's name, arguments and trace context.
//! One statement writes the row, the one that records the charge and finishes the key
//! ([`crate::writes::RecordCharge`]), for the api-server's phase and for an operator's
//! `workers admin key finish` alike.
//!
//! How a job travels on the broker is part of its type too: [`BackgroundJob::ROUTING_KEY`] and
//! [`BackgroundJob::QUEUE`] name its route and queue, [`BackgroundJob::message_body`] is what the
//! enqueuer publishes for its staged args and [`BackgroundJob::from_message`] what a consumer
//! reads back. The defaults publish the args as they are under the job's name; a type with a
//! versioned message of its own (the receipt's [`crate::message::ReceiptMessage`]) overrides them.

use chrono::{DateTime, Utc};
use schema::{JsonText, models::Ride};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::message::{DecodeError, RECEIPT_MESSAGE_TYPE, ReceiptMessage};

/// A job type: its name in `staged_jobs.job_name` and its arguments as `job_args`.
pub trait BackgroundJob: Serialize + DeserializeOwned {
    /// The value of `staged_jobs.job_name` for this type; never changes once jobs are staged.
    const JOB_NAME: &'static str;

    /// The routing key the enqueuer publishes this job under, and its queue's binding. Like the
    /// name, it never changes once messages are in flight.
    const ROUTING_KEY: &'static str = Self::JOB_NAME;

    /// The job's queue, after the topology's prefix: `{prefix}.{QUEUE}`.
    const QUEUE: &'static str = Self::JOB_NAME;

    /// The `job_args` to stage.
    fn to_args(&self) -> serde_json::Value {
        // The job types are plain fields: serialising them cannot fail.
        serde_json::to_value(self).unwrap_or_default()
    }

    /// Parses staged `job_args`; an error means the row was not written by this type.
    fn from_args(args: &serde_json::Value) -> Result<Self, serde_json::Error> {
        Self::deserialize(args)
    }

    /// The message body the enqueuer publishes for staged `job_args`; `None` when the args do not
    /// fit this type (they are then published as they are, so that the consumer dead-letters them
    /// where a person sees them instead of blocking the drain).
    fn message_body(args: &serde_json::Value) -> Option<Vec<u8>> {
        let job = Self::from_args(args).ok()?;
        serde_json::to_vec(&job).ok()
    }

    /// The job a delivered message body carries; an error dead-letters the delivery.
    fn from_message(body: &[u8]) -> Result<Self, DecodeError> {
        serde_json::from_slice(body).map_err(|error| DecodeError::Invalid(error.to_string()))
    }

    /// The row that stages this job, in the current span's trace: the enqueuer and the consumer
    /// continue the trace of the request (or the admin command) that staged it.
    fn staged(&self) -> JobToStage {
        // Plain fields and a map of strings: serialising cannot fail.
        JobToStage {
            job_name: Self::JOB_NAME,
            job_args: JsonText::of(self).unwrap_or_else(|_| JsonText::null()),
            trace_context: JsonText::of(&telemetry::inject_current())
                .unwrap_or_else(|_| JsonText::null()),
        }
    }
}

/// One `staged_jobs` row about to be written (`schema::models::StagedJob` is the row once read).
#[derive(Clone, Debug, PartialEq)]
pub struct JobToStage {
    pub job_name: &'static str,
    /// Written as it is (JSON text: [`JsonText`]), like the key's stored outcome beside it.
    pub job_args: JsonText,
    pub trace_context: JsonText,
}

/// The receipt staged when a ride is paid for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReceiptJob {
    pub ride_id: i64,
    pub user_id: i64,
    /// The provider's PaymentIntent id. A receipt is staged only for a charged ride; the
    /// enqueuer refuses args without one rather than publish a receipt for no charge.
    pub charge_id: Option<String>,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// Lower-case ISO 4217.
    pub currency: String,
    /// When the ride was created.
    pub created_at: DateTime<Utc>,
}

impl BackgroundJob for ReceiptJob {
    const JOB_NAME: &'static str = "send_ride_receipt";
    const ROUTING_KEY: &'static str = RECEIPT_MESSAGE_TYPE;
    const QUEUE: &'static str = "receipts";

    /// The versioned [`ReceiptMessage`] (docs/asyncapi.yaml); args without a charge are not one.
    fn message_body(args: &serde_json::Value) -> Option<Vec<u8>> {
        let job = ReceiptJob::from_args(args).ok()?;
        ReceiptMessage::from_job(job)?.encode().ok()
    }

    /// Decoded as a [`ReceiptMessage`], so unknown versions and types are refused; the job it
    /// carries always names a charge.
    fn from_message(body: &[u8]) -> Result<Self, DecodeError> {
        ReceiptMessage::decode(body).map(ReceiptJob::from)
    }
}

impl From<ReceiptMessage> for ReceiptJob {
    fn from(message: ReceiptMessage) -> ReceiptJob {
        ReceiptJob {
            ride_id: message.ride_id,
            user_id: message.user_id,
            charge_id: Some(message.charge_id),
            amount: message.amount,
            currency: message.currency,
            created_at: message.created_at,
        }
    }
}

impl From<&Ride> for ReceiptJob {
    fn from(ride: &Ride) -> ReceiptJob {
        ReceiptJob {
            ride_id: ride.id,
            user_id: ride.user_id,
            charge_id: ride.stripe_charge_id.clone(),
            amount: ride.amount,
            currency: ride.currency.clone(),
            created_at: ride.created_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receipt_job_parses_what_it_stages_and_refuses_other_args() {
        let job = ReceiptJob {
            ride_id: 7,
            user_id: 3,
            charge_id: Some("pi_1".into()),
            amount: 2000,
            currency: "usd".into(),
            created_at: DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
        };
        assert_eq!(ReceiptJob::from_args(&job.to_args()).unwrap(), job);
        assert!(ReceiptJob::from_args(&serde_json::json!({"ride_id": 7})).is_err());
        assert!(ReceiptJob::from_args(&serde_json::json!("send_ride_receipt")).is_err());
        let staged = job.staged();
        assert_eq!(staged.job_name, "send_ride_receipt");
        assert_eq!(
            ReceiptJob::from_args(&staged.job_args.to_value()).unwrap(),
            job
        );
        assert!(staged.trace_context.to_value().is_object());
    }

    #[test]
    fn a_receipt_job_travels_as_its_versioned_message() {
        let job = ReceiptJob {
            ride_id: 7,
            user_id: 3,
            charge_id: Some("pi_1".into()),
            amount: 2000,
            currency: "usd".into(),
            created_at: DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
        };
        let body = ReceiptJob::message_body(&job.to_args()).unwrap();
        assert_eq!(ReceiptMessage::decode(&body).unwrap().ride_id, 7);
        assert_eq!(ReceiptJob::from_message(&body).unwrap(), job);
        // A receipt for no charge is not a receipt message, nor are foreign args.
        let uncharged = ReceiptJob {
            charge_id: None,
            ..job
        };
        assert_eq!(ReceiptJob::message_body(&uncharged.to_args()), None);
        assert_eq!(
            ReceiptJob::message_body(&serde_json::json!({"ride_id": 7})),
            None
        );
        assert!(ReceiptJob::from_message(&uncharged.to_args().to_string().into_bytes()).is_err());
        assert_eq!(
            (ReceiptJob::ROUTING_KEY, ReceiptJob::QUEUE),
            ("ride.receipt", "receipts")
        );
    }
}
