//! `POST /v1/payment_intents`: parameters, declines, faults, idempotent execution.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, StatusCode};
use hyper::body::Incoming;
use tokio::sync::watch;

use crate::state::{FaultMode, PaymentIntent, State, StoredResponse, random_id};

use super::*;

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
    let amount = parse_amount(amount)?;
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

/// `amount`: required, an integer from 1 to [`MAX_AMOUNT`], with Stripe's error for each miss.
fn parse_amount(amount: Option<String>) -> Result<i64, ApiError> {
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
    Ok(amount)
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

pub(super) async fn create(
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
