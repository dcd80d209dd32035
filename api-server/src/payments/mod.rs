//! The payment provider: the `provider` crate's Stripe client (the one home of its HTTP calls and
//! error classification, shared with the workers' reconciler), as the ride flow uses it.

pub use provider::{ChargeError, ChargeRequest, PaymentIntent, StripeClient};
