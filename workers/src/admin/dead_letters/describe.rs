//! What a dead letter is, as an on-call reads it: its death headers, a summary of its body
//! with e-mail addresses scrubbed, and the line `dead-letters list` prints.

use crate::admin::render::time;

use chrono::{DateTime, TimeZone, Utc};
use lapin::{message::Delivery, types::AMQPValue};

use contract::message::ReceiptMessage;

use crate::redact;

use super::*;

/// Headers the broker writes when it dead-letters or redelivers a message. A requeued message
/// starts afresh without them (the broker adds new ones if it is dead-lettered again).
pub(super) const BROKER_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-reason",
    "x-first-death-queue",
    "x-first-death-exchange",
    "x-last-death-reason",
    "x-last-death-queue",
    "x-last-death-exchange",
    "x-delivery-count",
];

pub(super) fn describe(delivery: &Delivery) -> DeadLetter {
    let properties = &delivery.properties;
    let headers = properties.headers().as_ref();
    let header = |name: &str| headers.and_then(|table| table.inner().get(name));
    let death = header("x-death")
        .and_then(|value| match value {
            AMQPValue::FieldArray(array) => array.as_slice().first(),
            _ => None,
        })
        .and_then(|entry| match entry {
            AMQPValue::FieldTable(table) => Some(table),
            _ => None,
        })
        .map(|table| {
            let field = |name: &str| table.inner().get(name);
            Death {
                reason: field("reason").and_then(string),
                count: field("count").and_then(integer),
                queue: field("queue").and_then(string),
                time: field("time").and_then(timestamp),
            }
        });
    DeadLetter {
        message_id: properties.message_id().as_ref().map(|id| id.to_string()),
        job_name: header("x-job-name").and_then(string),
        routing_key: delivery.routing_key.to_string(),
        published_at: properties
            .timestamp()
            .and_then(|seconds| i64::try_from(seconds).ok())
            .and_then(|seconds| Utc.timestamp_opt(seconds, 0).single()),
        death,
        delivery_count: header("x-delivery-count").and_then(integer),
        summary: summarize(&delivery.data),
    }
}

/// A one-line description of a body that never prints more than a receipt's own fields: an
/// undecodable body shows why, its size and its field names, not its values.
pub fn summarize(body: &[u8]) -> String {
    match ReceiptMessage::decode(body) {
        Ok(receipt) => format!(
            "receipt v{}: ride {} user {} {} {} charge {}",
            receipt.version,
            receipt.ride_id,
            receipt.user_id,
            receipt.amount,
            receipt.currency,
            receipt.charge_id
        ),
        Err(error) => {
            let fields = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|value| {
                    value.as_object().map(|object| {
                        object
                            .keys()
                            .map(String::as_str)
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                });
            let mut reason: String = error.to_string().chars().take(160).collect();
            reason = scrub_emails(&reason);
            match fields {
                Some(fields) => format!(
                    "undecodable ({reason}); {} bytes, fields [{fields}]",
                    body.len()
                ),
                None => format!("undecodable ({reason}); {} bytes", body.len()),
            }
        }
    }
}

/// Replaces anything that looks like an e-mail address with its redacted form.
pub(super) fn scrub_emails(text: &str) -> String {
    text.split(' ')
        .map(|word| {
            if word.contains('@') {
                redact::email(word.trim_matches(|c: char| !c.is_alphanumeric()))
            } else {
                word.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

pub(super) fn string(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        AMQPValue::ShortString(text) => Some(text.as_str().to_owned()),
        _ => None,
    }
}

pub(super) fn integer(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        _ => None,
    }
}

pub(super) fn timestamp(value: &AMQPValue) -> Option<DateTime<Utc>> {
    match value {
        AMQPValue::Timestamp(seconds) => i64::try_from(*seconds)
            .ok()
            .and_then(|seconds| Utc.timestamp_opt(seconds, 0).single()),
        _ => None,
    }
}

pub(super) fn dead_letter_line(message: &DeadLetter) -> String {
    let death = message.death.as_ref().map_or_else(
        || "no x-death".to_owned(),
        |death| {
            format!(
                "{} x{} from {} at {}",
                death.reason.as_deref().unwrap_or("?"),
                death.count.unwrap_or(0),
                death.queue.as_deref().unwrap_or("?"),
                death.time.map_or_else(|| "?".to_owned(), time)
            )
        },
    );
    format!(
        "message {} job {} routing {}: {death}; {}",
        message.message_id.as_deref().unwrap_or("-"),
        message.job_name.as_deref().unwrap_or("-"),
        message.routing_key,
        message.summary
    )
}
