//! The jobs staged in `staged_jobs`, written in the business transaction (by the api-server, or
//! by `workers admin` finishing a key by hand) and drained by the enqueuer: each job's name and
//! the type of its `job_args`, so that both ends agree by construction.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::models::Ride;

/// Job name of the receipt staged when a ride is paid for.
pub const SEND_RIDE_RECEIPT_JOB: &str = "send_ride_receipt";

/// The `job_args` of [`SEND_RIDE_RECEIPT_JOB`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReceiptJobArgs {
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

impl From<&Ride> for ReceiptJobArgs {
    fn from(ride: &Ride) -> ReceiptJobArgs {
        ReceiptJobArgs {
            ride_id: ride.id,
            user_id: ride.user_id,
            charge_id: ride.stripe_charge_id.clone(),
            amount: ride.amount,
            currency: ride.currency.clone(),
            created_at: ride.created_at,
        }
    }
}
