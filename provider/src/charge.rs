//! The one call the api-server makes: `POST /v1/payment_intents` with `confirm=true` and
//! `off_session=true`, sent with an `Idempotency-Key` so that a retry after a timeout or a lost
//! response returns the PaymentIntent of the first attempt instead of charging again; and the
//! search that finds a charge whose key the provider may have forgotten.

use serde::Deserialize;

use crate::{
    BodyError, ErrorParts, MAX_RESPONSE_BYTES, PaymentIntent, StripeClient, error_parts,
    is_unavailable, read_body, transport_reason,
};

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
        /// A 409 `idempotency_key_in_use`: the provider is still running an earlier request with
        /// the same idempotency key (an attempt whose process died mid-charge, say); the same
        /// request is answered with that one's result once it is done.
        in_flight: bool,
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

impl StripeClient {
    #[tracing::instrument(
        name = "stripe",
        skip_all,
        fields(
            otel.name = "POST /v1/payment_intents",
            otel.kind = "client",
            http.request.method = "POST",
            url.full = %self.payment_intents,
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
            .post(self.payment_intents.clone())
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
        let body = read_body(response)
            .await
            .map_err(|error| body_error(status.as_u16(), error))?;
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
    /// Every PaymentIntent on the account whose `metadata[ride_id]` is `ride_id`, whoever made
    /// it. Used when the provider may already have forgotten our idempotency key, so that a
    /// charge that happened but was never recorded is found instead of repeated. The account is
    /// shared, so the caller keeps only what the ownership rule (`contract::ownership`) proves
    /// ours.
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
    pub async fn search_charges_for_ride(
        &self,
        ride_id: i64,
    ) -> Result<Vec<PaymentIntent>, ChargeError> {
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
        let body = read_body(response)
            .await
            .map_err(|error| body_error(status.as_u16(), error))?;
        if !status.is_success() {
            return Err(classify_body(status.as_u16(), &body));
        }
        let found: SearchResult =
            serde_json::from_slice(&body).map_err(|error| ChargeError::Rejected {
                status: status.as_u16(),
                error_type: "unreadable_response".into(),
                message: error.to_string(),
            })?;
        Ok(found.data)
    }
}

fn body_error(status: u16, error: BodyError) -> ChargeError {
    match error {
        BodyError::Transport(error) => unavailable(error),
        BodyError::TooLarge => ChargeError::Rejected {
            status,
            error_type: "response_too_large".into(),
            message: format!("the response body exceeds {MAX_RESPONSE_BYTES} bytes"),
        },
    }
}

fn unavailable(error: reqwest::Error) -> ChargeError {
    ChargeError::Unavailable {
        reason: transport_reason(&error).into(),
        in_flight: false,
        source: Some(error),
    }
}

/// Classifies an error answer from its status and (Stripe-shaped, if readable) body.
fn classify_body(status: u16, body: &[u8]) -> ChargeError {
    classify(error_parts(status, body))
}

fn classify(error: ErrorParts) -> ChargeError {
    match error.status {
        402 if error.error_type == "card_error" => ChargeError::Declined {
            message: error.message,
            code: error.code,
            decline_code: error.decline_code,
        },
        status if is_unavailable(status) => ChargeError::Unavailable {
            in_flight: status == 409 && error.code.as_deref() == Some("idempotency_key_in_use"),
            reason: format!("HTTP {status} {}", error.error_type),
            source: None,
        },
        status => ChargeError::Rejected {
            status,
            error_type: error.error_type,
            message: error.message,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stripe_error(status: u16, error_type: &str) -> ErrorParts {
        ErrorParts {
            status,
            error_type: error_type.into(),
            code: Some("card_declined".into()),
            decline_code: Some("generic_decline".into()),
            message: "Your card was declined.".into(),
        }
    }

    #[test]
    fn only_a_409_for_a_key_in_use_is_an_in_flight_request() {
        let in_use = ErrorParts {
            code: Some("idempotency_key_in_use".into()),
            ..stripe_error(409, "invalid_request_error")
        };
        assert!(matches!(
            classify(in_use),
            ChargeError::Unavailable {
                in_flight: true,
                ..
            }
        ));
        for status in [409, 429, 500] {
            assert!(matches!(
                classify(stripe_error(status, "api_error")),
                ChargeError::Unavailable {
                    in_flight: false,
                    ..
                }
            ));
        }
    }

    #[test]
    fn classifies_as_stripe_documents() {
        assert!(matches!(
            classify(stripe_error(402, "card_error")),
            ChargeError::Declined { ref message, .. } if message == "Your card was declined."
        ));
        for status in [409, 429, 500, 502, 503] {
            assert!(matches!(
                classify(stripe_error(status, "api_error")),
                ChargeError::Unavailable { .. }
            ));
        }
        assert!(matches!(
            classify(error_parts(503, b"<html>")),
            ChargeError::Unavailable { .. }
        ));
        for (status, error_type) in [
            (400, "invalid_request_error"),
            (400, "idempotency_error"),
            (401, "invalid_request_error"),
            (402, "invalid_request_error"),
        ] {
            assert!(matches!(
                classify(stripe_error(status, error_type)),
                ChargeError::Rejected { .. }
            ));
        }
    }
}
