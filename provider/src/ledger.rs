//! What the reconciler asks the provider: the PaymentIntents created in a window of time (Stripe's
//! list pagination: newest first, `created[gte]`/`created[lt]`, `starting_after`), one
//! PaymentIntent by id, and refunds, made under an idempotency key and listed per PaymentIntent.

use std::collections::{BTreeMap, HashSet};

use serde::Deserialize;

use crate::{
    BodyError, MAX_RESPONSE_BYTES, StripeClient, error_parts, is_unavailable, read_body,
    transport_reason,
};

/// Stripe's largest page.
const PAGE_LIMIT: u8 = 100;

/// An error of a ledger call. A charge has its own ([`crate::ChargeError`]): only there does a
/// 402 mean a declined card.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("the payment provider is unavailable: {reason}")]
    Unavailable {
        reason: String,
        #[source]
        source: Option<reqwest::Error>,
    },
    #[error(
        "the payment provider refused the request (HTTP {status}, {error_type}, code {}): {message}",
        code.as_deref().unwrap_or("none")
    )]
    Rejected {
        status: u16,
        error_type: String,
        /// Stripe's error code (`resource_missing`, `charge_already_refunded`, …).
        code: Option<String>,
        message: String,
    },
}

impl ProviderError {
    /// Stripe's error code of a refusal.
    pub fn code(&self) -> Option<&str> {
        match self {
            ProviderError::Unavailable { .. } => None,
            ProviderError::Rejected { code, .. } => code.as_deref(),
        }
    }

    fn unreadable(status: u16, error: &serde_json::Error) -> ProviderError {
        ProviderError::Rejected {
            status,
            error_type: "unreadable_response".into(),
            code: None,
            message: error.to_string(),
        }
    }
}

fn unavailable(error: reqwest::Error) -> ProviderError {
    ProviderError::Unavailable {
        reason: transport_reason(&error).into(),
        source: Some(error),
    }
}

fn classify(status: u16, body: &[u8]) -> ProviderError {
    let error = error_parts(status, body);
    if is_unavailable(status) {
        ProviderError::Unavailable {
            reason: format!("HTTP {status} {}", error.error_type),
            source: None,
        }
    } else {
        ProviderError::Rejected {
            status,
            error_type: error.error_type,
            code: error.code,
            message: error.message,
        }
    }
}

/// A PaymentIntent as the reconciler reads it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct ListedIntent {
    pub id: String,
    pub status: String,
    pub amount: i64,
    pub currency: String,
    /// The Stripe customer charged (the ownership rule compares it with the key's user's).
    #[serde(default)]
    pub customer: Option<String>,
    /// Unix seconds.
    pub created: i64,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The PaymentIntent's charge, expanded by the reconciler's reads (`expand[]`): what was
    /// refunded of it. A PaymentIntent that is refunded stays `succeeded`.
    #[serde(default)]
    pub latest_charge: Option<LatestCharge>,
}

/// A PaymentIntent's `latest_charge`: an id, or the Charge object when expanded.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum LatestCharge {
    Expanded { id: String, amount_refunded: i64 },
    Id(String),
}

impl ListedIntent {
    /// How much of the charge was refunded; `None` if the charge was not expanded (or there is
    /// none).
    pub fn amount_refunded(&self) -> Option<i64> {
        match &self.latest_charge {
            Some(LatestCharge::Expanded {
                amount_refunded, ..
            }) => Some(*amount_refunded),
            Some(LatestCharge::Id(_)) | None => None,
        }
    }
}

/// `created[gte]` ≤ created < `created[lt]`, in Unix seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreatedWindow {
    pub from: i64,
    pub until: i64,
}

/// A refund of (the rest of) a PaymentIntent's charge.
#[derive(Clone, Debug)]
pub struct RefundRequest {
    pub payment_intent: String,
    /// Stripe's `reason`: `duplicate`, `fraudulent` or `requested_by_customer`.
    pub reason: &'static str,
    pub metadata: Vec<(&'static str, String)>,
    /// The same for every attempt at the same refund, so that it is made once.
    pub idempotency_key: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Refund {
    pub id: String,
    pub amount: i64,
    pub currency: String,
    pub payment_intent: String,
    pub status: String,
    /// What the refunder attached (ours carry `finding_id`): how a refund is told apart from one
    /// someone else made of the same charge.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Page<T> {
    data: Vec<T>,
    has_more: bool,
}

impl StripeClient {
    /// Every PaymentIntent created in `window`, newest first, page by page (Stripe's cursor
    /// pagination: each next page starts after the last id of the one before), each with its
    /// charge expanded (what was refunded of it).
    #[tracing::instrument(name = "stripe.list", skip_all, fields(
        otel.kind = "client",
        window.from = window.from,
        window.until = window.until,
        pages = tracing::field::Empty,
    ))]
    pub async fn list_payment_intents(
        &self,
        window: CreatedWindow,
    ) -> Result<Vec<ListedIntent>, ProviderError> {
        let query = [
            ("created[gte]", window.from.to_string()),
            ("created[lt]", window.until.to_string()),
            ("expand[]", "data.latest_charge".to_owned()),
        ];
        let (intents, pages) = self
            .list_all("/v1/payment_intents", &query, |intent: &ListedIntent| {
                &intent.id
            })
            .await?;
        tracing::Span::current().record("pages", pages);
        Ok(intents)
    }

    /// One PaymentIntent; `None` when the provider has none by that id (`resource_missing`, or an
    /// id that cannot be one).
    #[tracing::instrument(name = "stripe.retrieve", skip_all, fields(otel.kind = "client"))]
    pub async fn retrieve_payment_intent(
        &self,
        id: &str,
    ) -> Result<Option<ListedIntent>, ProviderError> {
        // The id goes into the path: one outside Stripe's id alphabet is not sent (it could name
        // another route); no PaymentIntent has such an id.
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Ok(None);
        }
        let path = format!("/v1/payment_intents/{id}");
        let expand = [("expand[]", "latest_charge".to_owned())];
        match self.get_json(&path, &expand).await {
            Ok(intent) => Ok(Some(intent)),
            Err(error) if error.code() == Some("resource_missing") => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Refunds what is left of a PaymentIntent's charge, under the request's idempotency key.
    #[tracing::instrument(name = "stripe.refund", skip_all, fields(otel.kind = "client"))]
    pub async fn refund(&self, request: &RefundRequest) -> Result<Refund, ProviderError> {
        let mut form: Vec<(String, String)> = vec![
            ("payment_intent".into(), request.payment_intent.clone()),
            ("reason".into(), request.reason.into()),
        ];
        form.extend(
            request
                .metadata
                .iter()
                .map(|(key, value)| (format!("metadata[{key}]"), value.clone())),
        );
        let response = self
            .http
            .post(self.url("/v1/refunds"))
            .bearer_auth(self.secret_key.expose())
            .header("Idempotency-Key", &request.idempotency_key)
            .form(&form)
            .send()
            .await
            .map_err(unavailable)?;
        read_json(response).await
    }

    /// Every refund of a PaymentIntent, newest first, page by page.
    #[tracing::instrument(name = "stripe.list_refunds", skip_all, fields(otel.kind = "client"))]
    pub async fn list_refunds(&self, payment_intent: &str) -> Result<Vec<Refund>, ProviderError> {
        let query = [("payment_intent", payment_intent.to_owned())];
        let (refunds, _) = self
            .list_all("/v1/refunds", &query, |refund: &Refund| &refund.id)
            .await?;
        Ok(refunds)
    }

    /// Every item of a list endpoint for `query`, in the provider's order, and how many pages
    /// that took (Stripe's cursor pagination: each next page starts after the last id of the one
    /// before).
    async fn list_all<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
        id: fn(&T) -> &String,
    ) -> Result<(Vec<T>, u64), ProviderError> {
        let mut items: Vec<T> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut pages = 0_u64;
        loop {
            let mut page_query = query.to_vec();
            page_query.push(("limit", PAGE_LIMIT.to_string()));
            if let Some(last) = items.last() {
                page_query.push(("starting_after", id(last).clone()));
            }
            let page: Page<T> = self.get_json(path, &page_query).await?;
            pages += 1;
            // A list that hands back an item it already gave (a page repeated, a cursor that does
            // not move) would be walked forever or counted twice: stop with an error instead.
            if let Some(repeated) = page.data.iter().find(|item| !seen.insert(id(item).clone())) {
                return Err(ProviderError::Rejected {
                    status: 200,
                    error_type: "repeated_page".into(),
                    code: None,
                    message: format!(
                        "{path} page {pages} repeats {} (after {} items)",
                        id(repeated),
                        items.len()
                    ),
                });
            }
            // An empty page with has_more would ask for the same page forever; Stripe never
            // sends one.
            let last_page = !page.has_more || page.data.is_empty();
            items.extend(page.data);
            if last_page {
                return Ok((items, pages));
            }
        }
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, ProviderError> {
        let response = self
            .http
            .get(self.url(path))
            .bearer_auth(self.secret_key.expose())
            .query(query)
            .send()
            .await
            .map_err(unavailable)?;
        read_json(response).await
    }
}

async fn read_json<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
) -> Result<T, ProviderError> {
    let status = response.status().as_u16();
    let body = match read_body(response).await {
        Ok(body) => body,
        Err(BodyError::Transport(error)) => return Err(unavailable(error)),
        Err(BodyError::TooLarge) => {
            return Err(ProviderError::Rejected {
                status,
                error_type: "response_too_large".into(),
                code: None,
                message: format!("the response body exceeds {MAX_RESPONSE_BYTES} bytes"),
            });
        }
    };
    if !(200..300).contains(&status) {
        return Err(classify(status, &body));
    }
    serde_json::from_slice(&body).map_err(|error| ProviderError::unreadable(status, &error))
}
