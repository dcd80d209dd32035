//! The payment provider: a Stripe PaymentIntents client and the classification of its errors
//! into what the ride flow must do next (store a decline, retry later, or stop).

mod stripe;

pub use stripe::{ChargeError, ChargeRequest, PaymentIntent, StripeClient};
