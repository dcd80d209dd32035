//! HTTP layer: routing, authentication, parameter validation and Stripe-shaped responses.
//!
//! `handle` is the hyper service. It returns `Err(ConnectionFault)` only when a fault asks
//! for the connection to be closed without a response; hyper then drops the connection,
//! which is exactly what a client sees when a network path dies mid-request.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ALLOW, AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::state::{
    Begin, CreatedRange, FaultMode, PaymentIntent, State, StoredResponse, random_id,
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

/// Validated parameters of `POST /v1/payment_intents`.
struct CreateParams {
    amount: i64,
    currency: String,
    customer: Option<String>,
    payment_method: Option<String>,
    confirm: bool,
    description: Option<String>,
    metadata: BTreeMap<String, String>,
}

fn parse_bool(param: &str, value: &str) -> Result<bool, ApiError> {
    match value {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(ApiError::invalid(
            None,
            param,
            format!("Invalid boolean: {value}"),
        )),
    }
}

fn parse_create(pairs: &[(String, String)]) -> Result<CreateParams, ApiError> {
    let (mut amount, mut currency, mut customer, mut payment_method) = (None, None, None, None);
    let (mut confirm, mut description, mut metadata) = (false, None, BTreeMap::new());
    for (name, value) in pairs {
        let field = match name.as_str() {
            "amount" => &mut amount,
            "currency" => &mut currency,
            "customer" => &mut customer,
            "payment_method" => &mut payment_method,
            "description" => {
                // Stripe treats an empty value as "unset".
                description = Some(value.clone()).filter(|d| !d.is_empty());
                continue;
            }
            "confirm" | "off_session" => {
                let flag = parse_bool(name, value)?;
                if name == "confirm" {
                    confirm = flag;
                }
                continue;
            }
            _ => match name
                .strip_prefix("metadata[")
                .and_then(|k| k.strip_suffix(']'))
            {
                // Stripe treats an empty value as "unset", so it never lands in metadata.
                Some(key) if !key.is_empty() => {
                    if !value.is_empty() {
                        metadata.insert(key.to_owned(), value.clone());
                    }
                    continue;
                }
                _ => {
                    let msg = format!("Received unknown parameter: {name}");
                    return Err(ApiError::invalid(Some("parameter_unknown"), name, msg));
                }
            },
        };
        if value.is_empty() {
            return Err(ApiError::invalid(
                Some("parameter_invalid_empty"),
                name,
                format!(
                    "You passed an empty string for '{name}'. We assume empty values are an attempt to \
                     unset a parameter; however '{name}' cannot be unset. You should remove '{name}' from \
                     your request or supply a non-empty value."
                ),
            ));
        }
        *field = Some(value.clone());
    }
    let amount_raw = amount.ok_or_else(|| ApiError::missing("amount"))?;
    let amount: i64 = amount_raw.parse().map_err(|_| {
        ApiError::invalid(
            Some("parameter_invalid_integer"),
            "amount",
            format!("Invalid integer: {amount_raw}"),
        )
    })?;
    if amount < 1 {
        let msg = "This value must be greater than or equal to 1.";
        return Err(ApiError::invalid(
            Some("parameter_invalid_integer"),
            "amount",
            msg,
        ));
    }
    if amount > MAX_AMOUNT {
        let msg = "Amount must be no more than $999,999.99";
        return Err(ApiError::invalid(Some("amount_too_large"), "amount", msg));
    }
    let currency = currency.ok_or_else(|| ApiError::missing("currency"))?;
    if currency.len() != 3 || !currency.chars().all(|c| c.is_ascii_alphabetic()) {
        return Err(ApiError::invalid(
            None,
            "currency",
            format!("Invalid currency: {currency}."),
        ));
    }
    if confirm && payment_method.is_none() {
        return Err(ApiError::missing("payment_method"));
    }
    Ok(CreateParams {
        amount,
        currency: currency.to_ascii_lowercase(),
        customer,
        payment_method,
        confirm,
        description,
        metadata,
    })
}

/// Stripe's test payment methods that decline: `(code, decline_code, message)`.
fn decline_for(payment_method: &str) -> Option<(&'static str, &'static str, &'static str)> {
    match payment_method {
        "pm_card_chargeDeclined" => Some((
            "card_declined",
            "generic_decline",
            "Your card was declined.",
        )),
        "pm_card_chargeDeclinedInsufficientFunds" => Some((
            "card_declined",
            "insufficient_funds",
            "Your card has insufficient funds.",
        )),
        "pm_card_chargeDeclinedExpiredCard" => {
            Some(("expired_card", "expired_card", "Your card has expired."))
        }
        _ => None,
    }
}

/// Creates (and, with `confirm=true`, charges) a PaymentIntent, recording it in the ledger.
fn execute(
    state: &State,
    params: CreateParams,
    reservation: crate::state::Reservation,
) -> StoredResponse {
    let decline = params
        .payment_method
        .as_deref()
        .filter(|_| params.confirm)
        .and_then(decline_for);
    let status = match (params.confirm, decline, &params.payment_method) {
        (true, None, _) => "succeeded",
        (true, Some(_), _) | (false, _, None) => "requires_payment_method",
        (false, _, Some(_)) => "requires_confirmation",
    };
    let pi = PaymentIntent {
        id: random_id("pi_", 24),
        object: "payment_intent".to_owned(),
        amount: params.amount,
        amount_received: if status == "succeeded" {
            params.amount
        } else {
            0
        },
        currency: params.currency,
        customer: params.customer,
        // Like Stripe, a declined payment method is detached from the intent.
        payment_method: if decline.is_some() {
            None
        } else {
            params.payment_method
        },
        description: params.description,
        metadata: params.metadata,
        status: status.to_owned(),
        created: chrono::Utc::now().timestamp(),
        latest_charge: params.confirm.then(|| random_id("ch_", 24)),
        livemode: false,
        confirmation_method: "automatic".to_owned(),
    };
    state.record(pi, reservation, |pi| match decline {
        None => StoredResponse {
            status: StatusCode::OK,
            body: to_json(pi),
        },
        Some((code, decline_code, message)) => {
            let error = ErrorObject {
                kind: "card_error",
                code: Some(code),
                decline_code: Some(decline_code),
                message,
                charge: pi.latest_charge.as_deref(),
                payment_intent: Some(pi),
                ..ErrorObject::default()
            };
            StoredResponse {
                status: StatusCode::PAYMENT_REQUIRED,
                body: to_json(&ErrorBody { error }),
            }
        }
    })
}

async fn create(
    state: &Arc<State>,
    stop: watch::Receiver<bool>,
    req: Request<Incoming>,
) -> Result<HttpResponse, ConnectionFault> {
    state.count_create_call();
    let untargeted = state.next_fault();
    if let Some(answer) = refuse_for_fault(untargeted, &stop).await {
        return answer;
    }
    let request = match read_create(state, req).await {
        Ok(request) => request,
        Err(e) => return Ok(e.response()),
    };
    // A fault aimed at one customer's charges, when no other is due.
    let fault = untargeted.or_else(|| {
        request
            .params
            .customer
            .as_deref()
            .and_then(|customer| state.next_fault_for(customer))
    });
    if let Some(answer) = refuse_for_fault(fault, &stop).await {
        return answer;
    }
    let extra_delay = match fault {
        Some(FaultMode::Slow) => state.config.slow_fault_delay,
        _ => Duration::ZERO,
    };
    let response = match charge(state, request, extra_delay).await {
        Ok(response) => response,
        Err(e) => e.response(),
    };
    if fault == Some(FaultMode::ChargeThenDrop) {
        return Err(ConnectionFault::ChargeThenDrop);
    }
    Ok(response)
}

/// The answer of a fault that executes nothing (`error_500`, `timeout`); `None` for the others.
async fn refuse_for_fault(
    fault: Option<FaultMode>,
    stop: &watch::Receiver<bool>,
) -> Option<Result<HttpResponse, ConnectionFault>> {
    match fault {
        Some(FaultMode::Error500) => Some(Ok(ApiError::Api.response())),
        Some(FaultMode::Timeout) => {
            tracing::info!("timeout fault: holding the connection open until shutdown");
            crate::stopped(stop.clone()).await;
            Some(Err(ConnectionFault::Timeout))
        }
        Some(FaultMode::ChargeThenDrop | FaultMode::Slow) | None => None,
    }
}

/// A create request, authenticated and parsed.
struct CreateRequest {
    api_key: String,
    idempotency_key: Option<String>,
    pairs: Vec<(String, String)>,
    params: CreateParams,
}

async fn read_create(state: &State, req: Request<Incoming>) -> Result<CreateRequest, ApiError> {
    let api_key = authenticate(req.headers(), state)?;
    let idempotency_key = idempotency_key(req.headers())?;
    let mut pairs = read_form(req).await?;
    let params = parse_create(&pairs)?;
    pairs.sort();
    Ok(CreateRequest {
        api_key,
        idempotency_key,
        pairs,
        params,
    })
}

async fn charge(
    state: &Arc<State>,
    request: CreateRequest,
    extra_delay: Duration,
) -> Result<HttpResponse, ApiError> {
    let CreateRequest {
        api_key,
        idempotency_key,
        pairs,
        params,
    } = request;
    let key_for_messages = idempotency_key.clone().unwrap_or_default();
    let begin = state.begin(idempotency_key.map(|k| (api_key, k)), pairs);
    let reservation = match reserve(begin, &key_for_messages)? {
        Ok(reservation) => reservation,
        Err(replay) => return Ok(replay),
    };
    // Run the charge in its own task: like the real Stripe, a charge that has started
    // completes even if the client hangs up during the (simulated) provider latency.
    let task_state = Arc::clone(state);
    let latency = state.config.latency + extra_delay;
    let stored = tokio::spawn(async move {
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        execute(&task_state, params, reservation)
    })
    .await
    .map_err(|e| {
        tracing::error!(error = %e, "charge task failed");
        ApiError::Api
    })?;
    Ok(json_response(stored.status, stored.body))
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

/// Whether `expand[]` asks for the PaymentIntent's charge (`path`: `latest_charge`, or
/// `data.latest_charge` on a list): the one expansion this fake supports, as Stripe refuses what
/// it cannot expand.
fn expands_charge(params: &BTreeMap<String, String>, path: &str) -> Result<bool, ApiError> {
    match params.get("expand[]") {
        None => Ok(false),
        Some(value) if value == path => Ok(true),
        Some(value) => Err(ApiError::invalid(
            None,
            "expand",
            format!("This property cannot be expanded ({value})."),
        )),
    }
}

/// A PaymentIntent as JSON, with its charge expanded (`id`, `amount`, `amount_refunded`,
/// `refunded`, as Stripe's Charge object has them) if asked.
fn expanded(state: &State, pi: &PaymentIntent, expand: bool) -> serde_json::Value {
    let mut value = serde_json::to_value(pi).unwrap_or_default();
    if expand && let Some(charge) = &pi.latest_charge {
        let amount_refunded = state.amount_refunded(&pi.id);
        value["latest_charge"] = serde_json::json!({
            "id": charge,
            "object": "charge",
            "amount": pi.amount_received,
            "amount_refunded": amount_refunded,
            "refunded": amount_refunded >= pi.amount_received,
            "payment_intent": pi.id,
        });
    }
    value
}

fn list(state: &State, req: &Request<Incoming>) -> Result<HttpResponse, ApiError> {
    authenticate(req.headers(), state)?;
    let params = query_params(
        req,
        &[
            "limit",
            "starting_after",
            "customer",
            "expand[]",
            "created[gt]",
            "created[gte]",
            "created[lt]",
            "created[lte]",
        ],
    )?;
    let limit = parse_limit(params.get("limit").map(String::as_str))?;
    let starting_after = params.get("starting_after").map(String::as_str);
    let created = CreatedRange {
        gt: timestamp(&params, "created[gt]")?,
        gte: timestamp(&params, "created[gte]")?,
        lt: timestamp(&params, "created[lt]")?,
        lte: timestamp(&params, "created[lte]")?,
    };
    let (data, has_more) = state
        .list(
            limit,
            starting_after,
            params.get("customer").map(String::as_str),
            created,
        )
        .ok_or_else(|| ApiError::no_such_intent("starting_after", starting_after.unwrap_or("")))?;
    let expand = expands_charge(&params, "data.latest_charge")?;
    let data: Vec<serde_json::Value> = data.iter().map(|pi| expanded(state, pi, expand)).collect();
    let body = ListBody {
        object: "list",
        data: &data,
        has_more,
        next_page: None,
        url: "/v1/payment_intents",
    };
    Ok(json_response(StatusCode::OK, to_json(&body)))
}

/// A Unix-seconds bound such as `created[gte]`, as Stripe parses it: an integer.
fn timestamp(params: &BTreeMap<String, String>, name: &str) -> Result<Option<i64>, ApiError> {
    params
        .get(name)
        .map(|raw| {
            raw.parse().map_err(|_| {
                ApiError::invalid(
                    Some("parameter_invalid_integer"),
                    name,
                    format!("Invalid integer: {raw}"),
                )
            })
        })
        .transpose()
}

/// One clause of the supported search-query subset.
enum Clause {
    Metadata(String, String),
    Status(String),
}

/// Splits a `'quoted'` or `"quoted"` string off the front of `s`.
fn quoted(s: &str) -> Option<(&str, &str)> {
    let quote = s.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let rest = &s[1..];
    let end = rest.find(quote)?;
    Some((&rest[..end], &rest[end + 1..]))
}

fn parse_query(query: &str) -> Option<Vec<Clause>> {
    query
        .split(" AND ")
        .map(|clause| {
            let clause = clause.trim();
            if let Some(rest) = clause.strip_prefix("metadata[") {
                let (key, rest) = quoted(rest)?;
                let (value, rest) = quoted(rest.strip_prefix("]:")?)?;
                rest.is_empty()
                    .then(|| Clause::Metadata(key.to_owned(), value.to_owned()))
            } else {
                let (value, rest) = quoted(clause.strip_prefix("status:")?)?;
                rest.is_empty().then(|| Clause::Status(value.to_owned()))
            }
        })
        .collect()
}

fn search(state: &State, req: &Request<Incoming>) -> Result<HttpResponse, ApiError> {
    authenticate(req.headers(), state)?;
    let params = query_params(req, &["query"])?;
    let query = params
        .get("query")
        .ok_or_else(|| ApiError::missing("query"))?;
    let clauses = parse_query(query).ok_or_else(|| {
        let msg = format!(
            "Unsupported search query: {query}. This fake supports metadata['key']:'value' and \
             status:'value' clauses joined with AND."
        );
        ApiError::invalid(None, "query", msg)
    })?;
    // Stripe's search also pages, but our callers look up one ride: return every match.
    let data = state.search(|pi| {
        clauses.iter().all(|c| match c {
            Clause::Metadata(k, v) => pi.metadata.get(k) == Some(v),
            Clause::Status(s) => &pi.status == s,
        })
    });
    let body = ListBody {
        object: "search_result",
        data: &data,
        has_more: false,
        next_page: Some(None),
        url: "/v1/payment_intents/search",
    };
    Ok(json_response(StatusCode::OK, to_json(&body)))
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

    #[test]
    fn parses_supported_queries_only() {
        assert_eq!(
            parse_query("metadata['ride_id']:'123' AND status:'succeeded'").map(|c| c.len()),
            Some(2)
        );
        assert_eq!(
            parse_query("metadata[\"k\"]:\"v\"").map(|c| c.len()),
            Some(1)
        );
        assert!(parse_query("amount>100").is_none());
        assert!(parse_query("metadata['k']:'v' OR status:'succeeded'").is_none());
    }
}
