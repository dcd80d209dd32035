//! A Stripe client for the one call this service makes: `POST /v1/payment_intents` with
//! `confirm=true` and `off_session=true`, sent with an `Idempotency-Key` so that a retry after a
//! timeout or a lost response returns the PaymentIntent of the first attempt instead of charging
//! again.
//!
//! Errors are classified as Stripe documents them
//! (<https://docs.stripe.com/error-handling>):
//! - `card_error` (HTTP 402): the card was declined. Final; the outcome is stored.
//! - 429, 5xx, 409 (`idempotency_key_in_use`: the same key is still running at Stripe), timeouts
//!   and connection errors: the provider is unavailable. The charge may or may not have happened;
//!   a retry with the same idempotency key settles it.
//! - Anything else (`invalid_request_error`, `idempotency_error`, authentication errors): a bug
//!   or a misconfiguration on our side, surfaced as INTERNAL.

use std::time::Duration;

use serde::Deserialize;

use crate::config::{Secret, StripeConfig};

#[derive(Clone)]
pub struct StripeClient {
    http: reqwest::Client,
    api_base: String,
    secret_key: Secret,
    idempotency_window: Duration,
}

/// One charge. `idempotency_key` must be the same for every attempt at the same ride.
#[derive(Clone, Debug)]
pub struct ChargeRequest {
    pub amount: i64,
    pub currency: String,
    pub customer: String,
    pub payment_method: String,
    pub description: String,
    pub metadata: Vec<(&'static str, String)>,
    pub idempotency_key: String,
}

/// The fields of a PaymentIntent this service reads.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct PaymentIntent {
    pub id: String,
    pub status: String,
    pub amount: i64,
    pub currency: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ChargeError {
    #[error("the card was declined: {message}")]
    Declined {
        message: String,
        code: Option<String>,
        decline_code: Option<String>,
    },
    #[error("the payment provider is unavailable: {reason}")]
    Unavailable {
        reason: String,
        #[source]
        source: Option<reqwest::Error>,
    },
    #[error("the payment provider rejected the request (HTTP {status}, {error_type}): {message}")]
    Rejected {
        status: u16,
        error_type: String,
        message: String,
    },
}

#[derive(Debug, Deserialize)]
struct ErrorEnvelope {
    error: StripeError,
}

#[derive(Debug, Deserialize)]
struct StripeError {
    #[serde(rename = "type")]
    error_type: String,
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    decline_code: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

impl StripeClient {
    pub fn new(config: &StripeConfig) -> Result<StripeClient, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout.min(Duration::from_secs(5)))
            .user_agent(concat!("rocket-rides/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(StripeClient {
            http,
            api_base: config.api_base.clone(),
            secret_key: config.secret_key.clone(),
            idempotency_window: config.idempotency_window,
        })
    }

    #[tracing::instrument(
        name = "stripe",
        skip_all,
        fields(
            otel.name = "POST /v1/payment_intents",
            otel.kind = "client",
            http.request.method = "POST",
            url.full = %format_args!("{}/v1/payment_intents", self.api_base),
            server.address = tracing::field::Empty,
            http.response.status_code = tracing::field::Empty,
            error.type = tracing::field::Empty,
            rides.ride_id = charge.metadata.iter().find(|(key, _)| *key == "ride_id").map(|(_, id)| id.as_str()),
        )
    )]
    pub async fn create_payment_intent(
        &self,
        charge: &ChargeRequest,
    ) -> Result<PaymentIntent, ChargeError> {
        let result = self.send(charge).await;
        if let Err(error) = &result {
            let kind = match error {
                ChargeError::Declined { .. } => "card_declined",
                ChargeError::Unavailable { .. } => "unavailable",
                ChargeError::Rejected { .. } => "rejected",
            };
            tracing::Span::current().record("error.type", kind);
        }
        result
    }

    async fn send(&self, charge: &ChargeRequest) -> Result<PaymentIntent, ChargeError> {
        let mut form: Vec<(String, String)> = vec![
            ("amount".into(), charge.amount.to_string()),
            ("currency".into(), charge.currency.clone()),
            ("customer".into(), charge.customer.clone()),
            ("payment_method".into(), charge.payment_method.clone()),
            ("confirm".into(), "true".into()),
            ("off_session".into(), "true".into()),
            ("description".into(), charge.description.clone()),
        ];
        form.extend(
            charge
                .metadata
                .iter()
                .map(|(key, value)| (format!("metadata[{key}]"), value.clone())),
        );
        let response = self
            .http
            .post(format!("{}/v1/payment_intents", self.api_base))
            .bearer_auth(self.secret_key.expose())
            .header("Idempotency-Key", &charge.idempotency_key)
            .form(&form)
            .send()
            .await
            .map_err(unavailable)?;
        let status = response.status();
        let span = tracing::Span::current();
        span.record("http.response.status_code", i64::from(status.as_u16()));
        if let Some(host) = response.url().host_str() {
            span.record("server.address", host);
        }
        let body = response.bytes().await.map_err(unavailable)?;
        if status.is_success() {
            let intent: PaymentIntent =
                serde_json::from_slice(&body).map_err(|error| ChargeError::Rejected {
                    status: status.as_u16(),
                    error_type: "unreadable_response".into(),
                    message: error.to_string(),
                })?;
            return match intent.status.as_str() {
                "succeeded" => Ok(intent),
                other => Err(ChargeError::Rejected {
                    status: status.as_u16(),
                    error_type: "unexpected_status".into(),
                    message: format!("PaymentIntent {} is {other}", intent.id),
                }),
            };
        }
        Err(classify_body(status.as_u16(), &body))
    }
}

#[derive(Debug, Deserialize)]
struct SearchResult {
    data: Vec<PaymentIntent>,
}

impl StripeClient {
    /// How long the provider remembers an idempotency key.
    pub fn idempotency_window(&self) -> Duration {
        self.idempotency_window
    }

    /// A succeeded PaymentIntent created for `ride_id` (by its `metadata[ride_id]`), if any. Used
    /// when the provider may already have forgotten our idempotency key, so that a charge that
    /// happened but was never recorded is found instead of repeated.
    #[tracing::instrument(
        name = "stripe.search",
        skip_all,
        fields(
            otel.name = "GET /v1/payment_intents/search",
            otel.kind = "client",
            http.request.method = "GET",
            http.response.status_code = tracing::field::Empty,
            rides.ride_id = ride_id,
        )
    )]
    pub async fn find_succeeded_charge(
        &self,
        ride_id: i64,
    ) -> Result<Option<PaymentIntent>, ChargeError> {
        let response = self
            .http
            .get(format!("{}/v1/payment_intents/search", self.api_base))
            .bearer_auth(self.secret_key.expose())
            .query(&[("query", format!("metadata['ride_id']:'{ride_id}'"))])
            .send()
            .await
            .map_err(unavailable)?;
        let status = response.status();
        tracing::Span::current().record("http.response.status_code", i64::from(status.as_u16()));
        let body = response.bytes().await.map_err(unavailable)?;
        if !status.is_success() {
            return Err(classify_body(status.as_u16(), &body));
        }
        let found: SearchResult =
            serde_json::from_slice(&body).map_err(|error| ChargeError::Rejected {
                status: status.as_u16(),
                error_type: "unreadable_response".into(),
                message: error.to_string(),
            })?;
        Ok(found
            .data
            .into_iter()
            .find(|intent| intent.status == "succeeded"))
    }
}

fn unavailable(error: reqwest::Error) -> ChargeError {
    let reason = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    ChargeError::Unavailable {
        reason: reason.into(),
        source: Some(error),
    }
}

/// Classifies an error answer from its status and (Stripe-shaped, if readable) body.
fn classify_body(status: u16, body: &[u8]) -> ChargeError {
    let error = serde_json::from_slice::<ErrorEnvelope>(body)
        .map(|envelope| envelope.error)
        .ok();
    classify(status, error)
}

fn classify(status: u16, error: Option<StripeError>) -> ChargeError {
    let (error_type, code, decline_code, message) = match error {
        Some(error) => (
            error.error_type,
            error.code,
            error.decline_code,
            error.message.unwrap_or_default(),
        ),
        None => (
            "unparseable_error".into(),
            None,
            None,
            format!("HTTP {status} without a Stripe error body"),
        ),
    };
    match status {
        402 if error_type == "card_error" => ChargeError::Declined {
            message,
            code,
            decline_code,
        },
        409 | 429 | 500..=599 => ChargeError::Unavailable {
            reason: format!("HTTP {status} {error_type}"),
            source: None,
        },
        _ => ChargeError::Rejected {
            status,
            error_type,
            message,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stripe_error(error_type: &str) -> Option<StripeError> {
        Some(StripeError {
            error_type: error_type.into(),
            code: Some("card_declined".into()),
            decline_code: Some("generic_decline".into()),
            message: Some("Your card was declined.".into()),
        })
    }

    #[test]
    fn classifies_as_stripe_documents() {
        assert!(matches!(
            classify(402, stripe_error("card_error")),
            ChargeError::Declined { ref message, .. } if message == "Your card was declined."
        ));
        for status in [409, 429, 500, 502, 503] {
            assert!(matches!(
                classify(status, stripe_error("api_error")),
                ChargeError::Unavailable { .. }
            ));
        }
        assert!(matches!(
            classify(503, None),
            ChargeError::Unavailable { .. }
        ));
        for (status, error_type) in [
            (400, "invalid_request_error"),
            (400, "idempotency_error"),
            (401, "invalid_request_error"),
            (402, "invalid_request_error"),
        ] {
            assert!(matches!(
                classify(status, stripe_error(error_type)),
                ChargeError::Rejected { .. }
            ));
        }
    }
}
