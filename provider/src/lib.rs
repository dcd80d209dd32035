//! The payment provider: the one home of Stripe's HTTP client and of the classification of its
//! errors. The api-server charges through it (`charge`); the workers' reconciler lists
//! PaymentIntents and refunds through it (`ledger`). Neither depends on the other.
//!
//! Errors are classified as Stripe documents them
//! (<https://docs.stripe.com/error-handling>):
//! - `card_error` (HTTP 402) on a charge: the card was declined. Final; the outcome is stored.
//! - 429, 5xx, 409 (`idempotency_key_in_use`: the same key is still running at Stripe), timeouts
//!   and connection errors: the provider is unavailable. The call may or may not have taken
//!   effect; a retry with the same idempotency key settles it.
//! - Anything else (`invalid_request_error`, `idempotency_error`, authentication errors): a bug,
//!   a misconfiguration or a refusal (e.g. `charge_already_refunded`), never retried as is.
//!
//! The secret key is only ever sent as the bearer credential; it is a [`Secret`], which never
//! prints.

mod charge;
mod deployment;
mod ledger;

use std::time::Duration;

use serde::Deserialize;
pub use telemetry::Secret;

pub use charge::{ChargeError, ChargeRequest};
pub use deployment::{DEVELOPMENT_DEPLOYMENT_ID, DeploymentId, MAX_DEPLOYMENT_ID_LEN};
pub use ledger::{CreatedWindow, LatestCharge, ListedIntent, ProviderError, Refund, RefundRequest};

/// Where and how to reach the provider (`STRIPE_API_BASE`, `STRIPE_SECRET_KEY`,
/// `STRIPE_TIMEOUT_MS`, `STRIPE_IDEMPOTENCY_WINDOW_SECS`, `DEPLOYMENT_ID`, read by each binary's
/// configuration).
#[derive(Clone, Debug)]
pub struct StripeConfig {
    pub api_base: String,
    pub secret_key: Secret,
    pub timeout: Duration,
    /// How long the provider remembers an idempotency key (Stripe: 24 hours). A charge resumed
    /// later than that is looked up before it is retried.
    pub idempotency_window: Duration,
    /// Which installation this is: in every provider idempotency key and PaymentIntent.
    pub deployment_id: DeploymentId,
}

/// fake-stripe's default address: what a local run and the tests talk to.
pub const DEFAULT_STRIPE_API_BASE: &str = "http://127.0.0.1:12111";
/// Only meaningful against fake-stripe, which accepts any `sk_test_` key.
pub const DEFAULT_STRIPE_SECRET_KEY: &str = "sk_test_rocket_rides_development";

/// A provider variable that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("{name} is not valid: {reason}")]
pub struct InvalidVariable {
    pub name: &'static str,
    pub reason: String,
}

/// Each process reads the provider's variables with the rest of its configuration: the same
/// refusal, naming the variable.
impl From<InvalidVariable> for telemetry::settings::ConfigError {
    fn from(invalid: InvalidVariable) -> Self {
        telemetry::settings::ConfigError::Invalid {
            name: invalid.name,
            reason: invalid.reason,
        }
    }
}

impl StripeConfig {
    /// Whether this is a development configuration: one that talks to fake-stripe, neither to
    /// Stripe itself nor with a live key. Outside development, credentials must not be example
    /// values ([`Self::refuse_placeholders`]).
    pub fn is_development(&self) -> bool {
        !deployment::is_real_stripe(&self.api_base, self.secret_key.expose())
    }

    /// Outside development, refuses a secret key that is the development default or an example
    /// value, and `internal_token` (`INTERNAL_API_TOKEN`) if it is an example value or not
    /// random: the example secrets of `deploy/` must never start a server that charges cards.
    pub fn refuse_placeholders(
        &self,
        internal_token: Option<&str>,
    ) -> Result<(), telemetry::settings::ConfigError> {
        if self.is_development() {
            return Ok(());
        }
        let key = self.secret_key.expose();
        telemetry::settings::refuse_placeholder("STRIPE_SECRET_KEY", key)?;
        if key == DEFAULT_STRIPE_SECRET_KEY {
            return Err(telemetry::settings::ConfigError::Invalid {
                name: "STRIPE_SECRET_KEY",
                reason: "is the development default, against the real Stripe".into(),
            });
        }
        match internal_token {
            Some(token) => telemetry::settings::refuse_weak_secret("INTERNAL_API_TOKEN", token),
            None => Ok(()),
        }
    }

    /// Reads `STRIPE_API_BASE`, `STRIPE_SECRET_KEY`, `STRIPE_TIMEOUT_MS`,
    /// `STRIPE_IDEMPOTENCY_WINDOW_SECS` and `DEPLOYMENT_ID` through `lookup` (empty counts as
    /// unset): the one reading of these variables, for the api-server's and the workers'
    /// configuration alike.
    pub fn from_lookup(
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<StripeConfig, InvalidVariable> {
        let value = |name: &str| lookup(name).filter(|value| !value.is_empty());
        let vars = telemetry::settings::Vars::new(lookup);
        let duration = |read: Result<Duration, telemetry::settings::ConfigError>| {
            read.map_err(|error| match error {
                telemetry::settings::ConfigError::Invalid { name, reason } => {
                    InvalidVariable { name, reason }
                }
                telemetry::settings::ConfigError::Missing { name } => InvalidVariable {
                    name,
                    reason: "is required".into(),
                },
            })
        };
        let api_base = value("STRIPE_API_BASE")
            .unwrap_or_else(|| DEFAULT_STRIPE_API_BASE.to_owned())
            .trim_end_matches('/')
            .to_owned();
        let secret_key =
            value("STRIPE_SECRET_KEY").unwrap_or_else(|| DEFAULT_STRIPE_SECRET_KEY.to_owned());
        Ok(StripeConfig {
            deployment_id: DeploymentId::from_lookup(lookup, &api_base, &secret_key)?,
            api_base,
            secret_key: Secret::new(secret_key),
            timeout: duration(vars.millis("STRIPE_TIMEOUT_MS", 30_000))?,
            idempotency_window: duration(vars.secs("STRIPE_IDEMPOTENCY_WINDOW_SECS", 86_400))?,
        })
    }
}

#[derive(Clone)]
pub struct StripeClient {
    http: reqwest::Client,
    api_base: String,
    /// `{api_base}/v1/payment_intents`, parsed once: reqwest parses a URL given as a string on
    /// every request, and a charge is the hot path.
    payment_intents: reqwest::Url,
    secret_key: Secret,
    idempotency_window: Duration,
    deployment_id: DeploymentId,
}

/// The fields of a PaymentIntent this service reads.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct PaymentIntent {
    pub id: String,
    pub status: String,
    pub amount: i64,
    pub currency: String,
    #[serde(default)]
    pub customer: Option<String>,
    #[serde(default)]
    pub metadata: std::collections::BTreeMap<String, String>,
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
        // An invalid API base fails here, at start, instead of failing every charge.
        let payment_intents = http
            .post(format!("{}/v1/payment_intents", config.api_base))
            .build()?
            .url()
            .clone();
        Ok(StripeClient {
            http,
            api_base: config.api_base.clone(),
            payment_intents,
            secret_key: config.secret_key.clone(),
            idempotency_window: config.idempotency_window,
            deployment_id: config.deployment_id.clone(),
        })
    }

    /// This installation's deployment id (`DEPLOYMENT_ID`).
    pub fn deployment_id(&self) -> &DeploymentId {
        &self.deployment_id
    }

    /// How long the provider remembers an idempotency key.
    pub fn idempotency_window(&self) -> Duration {
        self.idempotency_window
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.api_base)
    }
}

/// What an error answer said, as far as it could be read.
#[derive(Debug)]
pub(crate) struct ErrorParts {
    pub status: u16,
    pub error_type: String,
    pub code: Option<String>,
    pub decline_code: Option<String>,
    pub message: String,
}

/// Reads an error answer from its status and (Stripe-shaped, if readable) body.
pub(crate) fn error_parts(status: u16, body: &[u8]) -> ErrorParts {
    match serde_json::from_slice::<ErrorEnvelope>(body) {
        Ok(envelope) => ErrorParts {
            status,
            error_type: envelope.error.error_type,
            code: envelope.error.code,
            decline_code: envelope.error.decline_code,
            message: envelope.error.message.unwrap_or_default(),
        },
        Err(_) => ErrorParts {
            status,
            error_type: "unparseable_error".into(),
            code: None,
            decline_code: None,
            message: format!("HTTP {status} without a Stripe error body"),
        },
    }
}

/// Whether an error answer means the provider is unavailable (retry later, same key) rather
/// than a refusal.
pub(crate) fn is_unavailable(status: u16) -> bool {
    matches!(status, 409 | 429 | 500..=599)
}

/// The largest response body read from the provider. Stripe's largest answer here, a page of
/// 100 PaymentIntents with expanded charges, is a few hundred kilobytes; anything beyond this is
/// not Stripe and is not read into memory.
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// Why a response body was not read.
#[derive(Debug)]
pub(crate) enum BodyError {
    Transport(reqwest::Error),
    TooLarge,
}

/// The response's body, read chunk by chunk up to [`MAX_RESPONSE_BYTES`].
pub(crate) async fn read_body(mut response: reqwest::Response) -> Result<Vec<u8>, BodyError> {
    if response
        .content_length()
        .is_some_and(|length| length > MAX_RESPONSE_BYTES as u64)
    {
        return Err(BodyError::TooLarge);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(BodyError::Transport)? {
        if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
            return Err(BodyError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Why a request got no answer.
pub(crate) fn transport_reason(error: &reqwest::Error) -> &'static str {
    if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "connection failed"
    } else {
        "request failed"
    }
}
