//! The payment provider: a Stripe PaymentIntents client and the classification of its errors
//! into what the ride flow must do next (store a decline, retry later, or stop).

mod stripe;

pub use stripe::{ChargeError, ChargeRequest, PaymentIntent, StripeClient};

/// The idempotency key presented to the provider for the charge of idempotency key row
/// `key_id`. Derived from the row, so every attempt at that ride, by any api-server or the
/// completer, presents the same key, and an operator can find the charge (`workers admin`).
pub fn provider_idempotency_key(key_id: i64) -> String {
    format!("rocket-rides-{key_id}")
}
