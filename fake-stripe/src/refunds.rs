//! `POST /v1/refunds` and `GET /v1/refunds`: refunds of succeeded PaymentIntents, as Stripe makes
//! them (<https://docs.stripe.com/api/refunds>). A refund honours `Idempotency-Key` exactly like
//! PaymentIntent creation (same scope, same replay, same 400 on other parameters, 409 while in
//! flight); the refunded PaymentIntent stays `succeeded`, and what it gave back is listed with
//! `GET /v1/refunds?payment_intent=pi_…`.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::{Request, StatusCode};
use hyper::body::Incoming;

use crate::api::{
    ApiError, HttpResponse, ListBody, authenticate, idempotency_key, json_response, parse_limit,
    query_params, read_form, reserve, to_json,
};
use crate::state::{RefundRefusal, State, StoredResponse};

/// Validated parameters of `POST /v1/refunds`.
struct RefundParams {
    payment_intent: String,
    amount: Option<i64>,
    reason: Option<String>,
    metadata: BTreeMap<String, String>,
}

const REASONS: [&str; 3] = ["duplicate", "fraudulent", "requested_by_customer"];

fn parse(pairs: &[(String, String)]) -> Result<RefundParams, ApiError> {
    let (mut payment_intent, mut amount, mut reason) = (None, None, None);
    let mut metadata = BTreeMap::new();
    for (name, value) in pairs {
        match name.as_str() {
            "payment_intent" => payment_intent = Some(value.clone()),
            "amount" => {
                let parsed: i64 = value.parse().map_err(|_| {
                    ApiError::invalid(
                        Some("parameter_invalid_integer"),
                        "amount",
                        format!("Invalid integer: {value}"),
                    )
                })?;
                if parsed < 1 {
                    return Err(ApiError::invalid(
                        Some("parameter_invalid_integer"),
                        "amount",
                        "This value must be greater than or equal to 1.",
                    ));
                }
                amount = Some(parsed);
            }
            "reason" => {
                if !REASONS.contains(&value.as_str()) {
                    return Err(ApiError::invalid(
                        None,
                        "reason",
                        format!("Invalid reason: must be one of {}", REASONS.join(", ")),
                    ));
                }
                reason = Some(value.clone());
            }
            _ => match name
                .strip_prefix("metadata[")
                .and_then(|key| key.strip_suffix(']'))
            {
                Some(key) if !key.is_empty() => {
                    if !value.is_empty() {
                        metadata.insert(key.to_owned(), value.clone());
                    }
                }
                _ => {
                    let msg = format!("Received unknown parameter: {name}");
                    return Err(ApiError::invalid(Some("parameter_unknown"), name, msg));
                }
            },
        }
    }
    // Stripe also refunds by `charge`; our callers only ever name the PaymentIntent.
    let payment_intent = payment_intent
        .filter(|id| !id.is_empty())
        .ok_or_else(|| ApiError::missing("payment_intent"))?;
    Ok(RefundParams {
        payment_intent,
        amount,
        reason,
        metadata,
    })
}

/// The error Stripe answers for a refund the ledger refuses.
fn refusal(refusal: RefundRefusal, params: &RefundParams) -> ApiError {
    let id = &params.payment_intent;
    match refusal {
        RefundRefusal::NoSuchIntent => ApiError::no_such_intent("payment_intent", id),
        RefundRefusal::NotSucceeded => ApiError::invalid(
            Some("charge_not_refundable"),
            "payment_intent",
            format!("This PaymentIntent ({id}) does not have a successful charge to refund."),
        ),
        RefundRefusal::AlreadyRefunded => ApiError::invalid(
            Some("charge_already_refunded"),
            "payment_intent",
            format!("The charge of PaymentIntent {id} has already been refunded."),
        ),
        RefundRefusal::TooLarge(left) => ApiError::invalid(
            Some("amount_too_large"),
            "amount",
            format!(
                "Refund amount ({}) is greater than unrefunded amount on charge ({left})",
                params.amount.unwrap_or_default()
            ),
        ),
    }
}

pub(crate) async fn create(
    state: &Arc<State>,
    req: Request<Incoming>,
) -> Result<HttpResponse, ApiError> {
    let api_key = authenticate(req.headers(), state)?;
    let key = idempotency_key(req.headers())?;
    let mut pairs = read_form(req).await?;
    let params = parse(&pairs)?;
    // The endpoint is part of what a key was first used with: the same key on a charge and on a
    // refund is an idempotency error, as at Stripe.
    pairs.push(("(endpoint)".to_owned(), "/v1/refunds".to_owned()));
    pairs.sort();
    let key_for_messages = key.clone().unwrap_or_default();
    let begin = state.begin(key.map(|key| (api_key, key)), pairs);
    let reservation = match reserve(begin, &key_for_messages)? {
        Ok(reservation) => reservation,
        Err(replay) => return Ok(replay),
    };
    let stored = state
        .refund(
            &params.payment_intent,
            params.amount,
            params.reason.clone(),
            params.metadata.clone(),
            reservation,
            |refund| StoredResponse {
                status: StatusCode::OK,
                body: to_json(refund),
            },
        )
        .map_err(|refused| refusal(refused, &params))?;
    Ok(json_response(stored.status, stored.body))
}

pub(crate) fn list(state: &State, req: &Request<Incoming>) -> Result<HttpResponse, ApiError> {
    authenticate(req.headers(), state)?;
    let params = query_params(req, &["limit", "starting_after", "payment_intent"])?;
    let limit = parse_limit(params.get("limit").map(String::as_str))?;
    let starting_after = params.get("starting_after").map(String::as_str);
    let (data, has_more) = state
        .list_refunds(
            limit,
            starting_after,
            params.get("payment_intent").map(String::as_str),
        )
        .ok_or_else(|| {
            let id = starting_after.unwrap_or("");
            ApiError::InvalidRequest {
                status: StatusCode::BAD_REQUEST,
                code: Some("resource_missing"),
                param: Some("starting_after".to_owned()),
                message: format!("No such refund: '{id}'"),
            }
        })?;
    let body = ListBody {
        object: "list",
        data: &data,
        has_more,
        next_page: None,
        url: "/v1/refunds",
    };
    Ok(json_response(StatusCode::OK, to_json(&body)))
}
