//! `key finish --outcome succeeded --charge-id pi_…`: the PaymentIntent an operator names is
//! recorded as the ride's payment only if the one ownership rule (`contract::ownership`) proves it
//! this ride's charge, as it stands at the provider now: an id copied from the wrong line of a
//! dashboard, another product's charge on the shared account, or another environment's, must
//! never become a paid ride with a receipt. It must also have succeeded and not have been
//! refunded (a refunded charge never pays for a ride: docs/money-safety.md). Anything else is
//! refused before anything is written.

use contract::ownership::{self, KeyRecord};
use diesel::{OptionalExtension, QueryDsl};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use provider::StripeClient;
use schema::{models::Ride, schema::users};

use super::AdminError;

/// Refuses unless `charge_id` is provably the charge of key `key_id`'s `ride`.
pub(super) async fn check(
    conn: &mut AsyncPgConnection,
    stripe: &StripeClient,
    key_id: i64,
    ride: &Ride,
    charge_id: &str,
) -> Result<(), AdminError> {
    let refused = |why: String| {
        AdminError::Refused(format!(
            "PaymentIntent {charge_id} {why}; nothing was written. Check it at the provider: \
             this ride's charge carries metadata idempotency_key_id={key_id}, ride_id={}, the \
             rider's customer and the ride's amount ({} {}).",
            ride.id, ride.amount, ride.currency
        ))
    };
    let Some(intent) = stripe.retrieve_payment_intent(charge_id).await? else {
        return Err(refused("does not exist at the provider".to_owned()));
    };
    let customer: Option<String> = users::table
        .find(ride.user_id)
        .select(users::stripe_customer_id)
        .first(conn)
        .await
        .optional()?;
    let Some(customer) = customer else {
        return Err(refused(format!(
            "cannot be checked: user {} is gone",
            ride.user_id
        )));
    };
    let record = KeyRecord {
        key_id,
        deployment_id: ride.deployment_id.as_deref(),
        customer: &customer,
        ride_id: ride.id,
        amount: ride.amount,
        currency: &ride.currency,
    };
    let facts = crate::reconciler::classify::intent_facts(&intent);
    if let Err(why) = ownership::verdict(stripe.deployment_id().as_str(), &facts, Some(&record)) {
        return Err(refused(format!(
            "is not provably this ride's charge ({why})"
        )));
    }
    if intent.status != "succeeded" {
        return Err(refused(format!(
            "has not succeeded (status {}): it paid for nothing",
            intent.status
        )));
    }
    match intent.amount_refunded() {
        Some(0) => Ok(()),
        Some(refunded) => Err(refused(format!(
            "was refunded ({refunded} of {}): a refunded charge never pays for a ride",
            intent.amount
        ))),
        None => Err(refused(
            "came without its charge, so whether it was refunded is unknown".to_owned(),
        )),
    }
}
