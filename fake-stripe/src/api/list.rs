//! `GET /v1/payment_intents` (a page, by creation time and customer) and
//! `GET /v1/payment_intents/search` (the metadata and status queries the service uses).

use std::collections::BTreeMap;

use http::{Request, StatusCode};
use hyper::body::Incoming;

use crate::state::{CreatedRange, PaymentIntent, State};

use super::*;

/// Whether `expand[]` asks for the PaymentIntent's charge (`path`: `latest_charge`, or
/// `data.latest_charge` on a list): the one expansion this fake supports, as Stripe refuses what
/// it cannot expand.
pub(super) fn expands_charge(
    params: &BTreeMap<String, String>,
    path: &str,
) -> Result<bool, ApiError> {
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
pub(super) fn expanded(state: &State, pi: &PaymentIntent, expand: bool) -> serde_json::Value {
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

pub(super) fn list(state: &State, req: &Request<Incoming>) -> Result<HttpResponse, ApiError> {
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

pub(super) fn search(state: &State, req: &Request<Incoming>) -> Result<HttpResponse, ApiError> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
