//! The jobs staged in `staged_jobs`, written in the business transaction (by the api-server's
//! last phase, or by `workers admin key finish`) and drained by the enqueuer. Each job type is one
//! struct that both builds and parses its `job_args`, so producer and consumer agree by
//! construction (after crates.io's `BackgroundJob`, whose name this trait keeps).
//!
//! Staging has one home, [`BackgroundJob::staged`]: the row's name, arguments and trace context.
//! One statement writes the row, the one that records the charge and finishes the key
//! ([`crate::writes::RecordCharge`]), for the api-server's phase and for an operator's
//! `workers admin key finish` alike.

use chrono::{DateTime, Utc};
use schema::models::Ride;
use serde::{Deserialize, Serialize, de::DeserializeOwned};

/// A job type: its name in `staged_jobs.job_name` and its arguments as `job_args`.
pub trait BackgroundJob: Serialize + DeserializeOwned {
    /// The value of `staged_jobs.job_name` for this type; never changes once jobs are staged.
    const JOB_NAME: &'static str;

    /// The `job_args` to stage.
    fn to_args(&self) -> serde_json::Value {
        // The job types are plain fields: serialising them cannot fail.
        serde_json::to_value(self).unwrap_or_default()
    }

    /// Parses staged `job_args`; an error means the row was not written by this type.
    fn from_args(args: &serde_json::Value) -> Result<Self, serde_json::Error> {
        Self::deserialize(args)
    }

    /// The row that stages this job, in the current span's trace: the enqueuer and the consumer
    /// continue the trace of the request (or the admin command) that staged it.
    fn staged(&self) -> JobToStage {
        JobToStage {
            job_name: Self::JOB_NAME,
            job_args: self.to_args(),
            trace_context: serde_json::to_value(telemetry::inject_current()).unwrap_or_default(),
        }
    }
}

/// One `staged_jobs` row about to be written (`schema::models::StagedJob` is the row once read).
#[derive(Clone, Debug, PartialEq)]
pub struct JobToStage {
    pub job_name: &'static str,
    pub job_args: serde_json::Value,
    pub trace_context: serde_json::Value,
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
        assert_eq!(ReceiptJob::from_args(&staged.job_args).unwrap(), job);
        assert!(staged.trace_context.is_object());
    }
}
