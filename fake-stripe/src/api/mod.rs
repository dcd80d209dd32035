//! HTTP layer: routing, authentication, parameter validation and Stripe-shaped responses.
//! Creating a PaymentIntent is `create.rs`; listing and searching them is `list.rs`; the refunds
//! are `crate::refunds`.
//!
//! `handle` is the hyper service. It returns `Err(ConnectionFault)` only when a fault asks
//! for the connection to be closed without a response; hyper then drops the connection,
//! which is exactly what a client sees when a network path dies mid-request.
use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{ALLOW, AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::state::{Begin, FaultMode, PaymentIntent, State, random_id};

mod create;
mod list;

use self::{
    create::create,
    list::{expanded, expands_charge, list, search},
};

/// Stripe rejects larger bodies too; this keeps a misbehaving client from exhausting memory.
const MAX_BODY_BYTES: usize = 1 << 20;
const MAX_LIMIT: usize = 100;
/// Stripe's cap for a USD amount: $999,999.99.
const MAX_AMOUNT: i64 = 99_999_999;
pub(crate) const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;
const DOCS: &str =
    "Please see https://stripe.com/docs or we can help at https://support.stripe.com/.";

/// Why a connection was closed without writing a response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectionFault {
    #[error("connection dropped after charging (charge_then_drop fault)")]
    ChargeThenDrop,
    #[error("connection held open without an answer until shutdown (timeout fault)")]
    Timeout,
}

/// An error answered before (or instead of) executing the endpoint; never stored under an
/// idempotency key, since Stripe only saves results once execution has started.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    #[error("{message}")]
    InvalidRequest {
        status: StatusCode,
        code: Option<&'static str>,
        param: Option<String>,
        message: String,
    },
    #[error("{message}")]
    Idempotency {
        status: StatusCode,
        code: Option<&'static str>,
        message: String,
    },
    #[error("An unknown error occurred")]
    Api,
}

impl ApiError {
    pub(crate) fn invalid(
        code: Option<&'static str>,
        param: &str,
        message: impl Into<String>,
    ) -> Self {
        ApiError::InvalidRequest {
            status: StatusCode::BAD_REQUEST,
            code,
            param: Some(param.to_owned()),
            message: message.into(),
        }
    }

    pub(crate) fn bare(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            status,
            code: None,
            param: None,
            message: message.into(),
        }
    }

    pub(crate) fn missing(param: &str) -> Self {
        Self::invalid(
            Some("parameter_missing"),
            param,
            format!("Missing required param: {param}."),
        )
    }

    pub(crate) fn no_such_intent(param: &str, id: &str) -> Self {
        ApiError::InvalidRequest {
            status: if param == "intent" {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::BAD_REQUEST
            },
            code: Some("resource_missing"),
            param: Some(param.to_owned()),
            message: format!("No such payment_intent: '{id}'"),
        }
    }

    pub(crate) fn response(&self) -> Response<Full<Bytes>> {
        let message = self.to_string();
        let (status, kind, code, param) = match self {
            ApiError::InvalidRequest {
                status,
                code,
                param,
                ..
            } => (*status, "invalid_request_error", *code, param.as_deref()),
            ApiError::Idempotency { status, code, .. } => {
                (*status, "idempotency_error", *code, None)
            }
            ApiError::Api => (StatusCode::INTERNAL_SERVER_ERROR, "api_error", None, None),
        };
        let error = ErrorObject {
            kind,
            code,
            param,
            message: &message,
            ..ErrorObject::default()
        };
        json_response(status, to_json(&ErrorBody { error }))
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

#[derive(Serialize, Default)]
struct ErrorObject<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decline_code: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'a str>,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    charge: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payment_intent: Option<&'a PaymentIntent>,
}

/// Both `list` and `search_result` envelopes; `next_page` only exists on search results.
#[derive(Serialize)]
pub(crate) struct ListBody<'a, T> {
    pub(crate) object: &'static str,
    pub(crate) data: &'a [T],
    pub(crate) has_more: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) next_page: Option<Option<String>>,
    pub(crate) url: &'static str,
}

#[derive(Deserialize)]
struct FaultRequest {
    mode: FaultMode,
    #[serde(default = "one")]
    count: usize,
    /// Aim the faults at this customer's charges only: they replace the customer's pending ones
    /// (`count` 0 clears them), and apply when no untargeted fault is due.
    #[serde(default)]
    customer: Option<String>,
}

fn one() -> usize {
    1
}

pub(crate) type HttpResponse = Response<Full<Bytes>>;

/// Serialising our own plain structs cannot fail; the fallback only keeps us panic-free.
pub(crate) fn to_json<T: Serialize>(value: &T) -> Bytes {
    serde_json::to_vec(value)
        .map(Bytes::from)
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "failed to serialise response");
            Bytes::from_static(
                br#"{"error":{"type":"api_error","message":"An unknown error occurred"}}"#,
            )
        })
}

pub(crate) fn json_response(status: StatusCode, body: Bytes) -> HttpResponse {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Ok(id) = HeaderValue::from_str(&random_id("req_", 14)) {
        headers.insert("request-id", id);
    }
    response
}

/// The service entry point: one call per HTTP request.
pub(crate) async fn handle(
    state: Arc<State>,
    stop: watch::Receiver<bool>,
    req: Request<Incoming>,
) -> Result<HttpResponse, ConnectionFault> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let result = match (path.as_str(), path.strip_prefix("/v1/payment_intents/")) {
        ("/v1/payment_intents", _) => match method {
            Method::POST => return create(&state, stop, req).await,
            Method::GET => list(&state, &req),
            _ => method_not_allowed(&method, &path, "GET, POST"),
        },
        (_, Some("search")) if method == Method::GET => search(&state, &req),
        (_, Some(id)) if !id.is_empty() && !id.contains('/') => match method {
            Method::GET if state.retrieve_fails() => Ok(ApiError::Api.response()),
            Method::GET => authenticate(req.headers(), &state)
                .and_then(|_| query_params(&req, &["expand[]"]))
                .and_then(|params| {
                    let expand = expands_charge(&params, "latest_charge")?;
                    let pi = state
                        .get(id)
                        .ok_or_else(|| ApiError::no_such_intent("intent", id))?;
                    Ok(json_response(
                        StatusCode::OK,
                        to_json(&expanded(&state, &pi, expand)),
                    ))
                }),
            _ => method_not_allowed(&method, &path, "GET"),
        },
        ("/v1/refunds", _) => match method {
            Method::POST => crate::refunds::create(&state, req).await,
            Method::GET => crate::refunds::list(&state, &req),
            _ => method_not_allowed(&method, &path, "GET, POST"),
        },
        ("/_faults", _) => match method {
            Method::POST => faults(&state, req).await,
            Method::DELETE => {
                state.clear_faults();
                Ok(json_response(
                    StatusCode::OK,
                    Bytes::from_static(br#"{"pending":0}"#),
                ))
            }
            _ => method_not_allowed(&method, &path, "POST, DELETE"),
        },
        _ => Err(ApiError::bare(
            StatusCode::NOT_FOUND,
            format!("Unrecognized request URL ({method}: {path}). {DOCS}"),
        )),
    };
    Ok(result.unwrap_or_else(|e| e.response()))
}

/// Stripe itself answers 404 here; we use 405 with `Allow` so test failures are obvious.
pub(crate) fn method_not_allowed(
    method: &Method,
    path: &str,
    allow: &'static str,
) -> Result<HttpResponse, ApiError> {
    let message = format!("Unrecognized request URL ({method}: {path}). {DOCS}");
    let mut response = ApiError::bare(StatusCode::METHOD_NOT_ALLOWED, message).response();
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    Ok(response)
}

/// Masks a key the way Stripe does in error messages: prefix, stars, last four.
fn mask_key(key: &str) -> String {
    let prefix = ["sk_test_", "sk_live_", "rk_test_", "rk_live_"]
        .into_iter()
        .find(|p| key.starts_with(p))
        .unwrap_or("");
    let rest: Vec<char> = key[prefix.len()..].chars().collect();
    // Short keys are masked completely: revealing "the last four" of six chars reveals too much.
    let shown = if rest.len() > 4 {
        &rest[rest.len() - 4..]
    } else {
        &[]
    };
    let tail: String = shown.iter().collect();
    format!("{prefix}****{tail}")
}

/// Returns the caller's API key, which also scopes its idempotency keys.
pub(crate) fn authenticate(headers: &HeaderMap, state: &State) -> Result<String, ApiError> {
    let Some(value) = headers.get(AUTHORIZATION) else {
        return Err(ApiError::bare(
            StatusCode::UNAUTHORIZED,
            "You did not provide an API key. You need to provide your API key in the Authorization \
             header, using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY'). See \
             https://stripe.com/docs/api#authentication for details, or we can help at \
             https://support.stripe.com/.",
        ));
    };
    let key = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .unwrap_or("");
    let valid = match &state.config.api_key {
        Some(expected) => !key.is_empty() && key == expected,
        None => key.starts_with("sk_test_") && key.len() > "sk_test_".len(),
    };
    if valid {
        Ok(key.to_owned())
    } else {
        Err(ApiError::bare(
            StatusCode::UNAUTHORIZED,
            format!("Invalid API Key provided: {}", mask_key(key)),
        ))
    }
}

/// The request's `Idempotency-Key`, if it sent one.
pub(crate) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    match headers.get("idempotency-key") {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Ok(k) if !k.is_empty() && k.len() <= MAX_IDEMPOTENCY_KEY_LEN => Ok(Some(k.to_owned())),
            _ => {
                let msg = format!(
                    "Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters."
                );
                Err(ApiError::bare(StatusCode::BAD_REQUEST, msg))
            }
        },
    }
}

/// What presenting an idempotency key decided, shared by every idempotent endpoint: go ahead
/// (`Ok(Ok(reservation))`), replay the stored answer (`Ok(Err(response))`), or refuse.
pub(crate) fn reserve(
    begin: Begin,
    key: &str,
) -> Result<Result<crate::state::Reservation, HttpResponse>, ApiError> {
    match begin {
        Begin::Execute(reservation) => Ok(Ok(reservation)),
        Begin::Replay(stored) => {
            let mut response = json_response(stored.status, stored.body);
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(Err(response))
        }
        Begin::Mismatch => Err(ApiError::Idempotency {
            status: StatusCode::BAD_REQUEST,
            code: None,
            message: format!(
                "Keys for idempotent requests can only be used with the same parameters they were \
                 first used with. Try using a key other than '{key}' if you meant to \
                 execute a different request."
            ),
        }),
        Begin::InUse => Err(ApiError::Idempotency {
            status: StatusCode::CONFLICT,
            code: Some("idempotency_key_in_use"),
            message: format!(
                "There is currently another in-progress request using this Idempotent Key (that \
                 probably means you submitted twice, and the other request is still going \
                 through): {key}. Please try again later."
            ),
        }),
    }
}

/// The request's form-encoded body as name/value pairs, in order.
pub(crate) async fn read_form(req: Request<Incoming>) -> Result<Vec<(String, String)>, ApiError> {
    let body = read_body(req).await?;
    serde_urlencoded::from_bytes(&body).map_err(|e| {
        ApiError::bare(
            StatusCode::BAD_REQUEST,
            format!("Invalid application/x-www-form-urlencoded body: {e}"),
        )
    })
}

pub(crate) async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(body) => Ok(body.to_bytes()),
        Err(e) => Err(ApiError::bare(
            StatusCode::BAD_REQUEST,
            format!("Could not read body: {e}"),
        )),
    }
}

/// Parses `limit` the way Stripe does: integer in `1..=100`, default 10.
pub(crate) fn parse_limit(value: Option<&str>) -> Result<usize, ApiError> {
    let Some(raw) = value else { return Ok(10) };
    let limit: i64 = raw.parse().map_err(|_| {
        ApiError::invalid(
            Some("parameter_invalid_integer"),
            "limit",
            format!("Invalid integer: {raw}"),
        )
    })?;
    match usize::try_from(limit) {
        Ok(l) if (1..=MAX_LIMIT).contains(&l) => Ok(l),
        _ if limit < 1 => Err(ApiError::invalid(
            None,
            "limit",
            "This value must be greater than or equal to 1.",
        )),
        _ => Err(ApiError::invalid(
            None,
            "limit",
            format!("This value must be less than or equal to {MAX_LIMIT}."),
        )),
    }
}

/// Decodes the query string, rejecting parameters the endpoint does not know.
pub(crate) fn query_params(
    req: &Request<Incoming>,
    allowed: &[&str],
) -> Result<BTreeMap<String, String>, ApiError> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(req.uri().query().unwrap_or(""))
        .map_err(|e| {
            ApiError::bare(
                StatusCode::BAD_REQUEST,
                format!("Invalid query string: {e}"),
            )
        })?;
    let mut params = BTreeMap::new();
    for (name, value) in pairs {
        if !allowed.contains(&name.as_str()) {
            let msg = format!("Received unknown parameter: {name}");
            return Err(ApiError::invalid(Some("parameter_unknown"), &name, msg));
        }
        params.insert(name, value);
    }
    Ok(params)
}

async fn faults(state: &State, req: Request<Incoming>) -> Result<HttpResponse, ApiError> {
    let body = read_body(req).await?;
    let request: FaultRequest = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bare(
            StatusCode::BAD_REQUEST,
            format!("Invalid fault request: {e}"),
        )
    })?;
    let pending = match &request.customer {
        Some(customer) => state.inject_faults_for(customer, request.mode, request.count),
        None => state.inject_faults(request.mode, request.count),
    };
    Ok(json_response(
        StatusCode::OK,
        Bytes::from(format!(r#"{{"pending":{pending}}}"#)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_keys_like_stripe() {
        assert_eq!(mask_key("sk_test_1234567890abcd"), "sk_test_****abcd");
        assert_eq!(mask_key("sk_test_ab"), "sk_test_****");
        assert_eq!(mask_key("garbage-key-wxyz"), "****wxyz");
    }
}
