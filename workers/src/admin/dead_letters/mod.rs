//! `workers admin dead-letters list|requeue`: the receipt messages in `P.dead-letter`.
//!
//! Listing takes messages with `basic.get` and holds them unacknowledged until it has seen
//! enough (so it never sees one twice), then returns them all with `basic.nack` + requeue. If the
//! process dies part-way the broker returns them when the connection closes. They stay in the
//! dead-letter queue either way (possibly in a different order).
//!
//! Requeueing moves one message at a time: take it, republish it to the topology's exchange
//! with the receipts routing key (publisher confirms, `mandatory`), and ack the dead-lettered
//! copy only once the broker confirmed the republished one as routed. A message the broker
//! refuses or cannot route is returned to the dead-letter queue and the command stops. A crash
//! between the confirm and the ack leaves both copies: the receipt worker deduplicates per ride.

use std::fmt::Write as _;

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::{
    BasicProperties, Channel, Confirmation,
    message::Delivery,
    options::{
        BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
        ConfirmSelectOptions,
    },
    types::{DeliveryTag, FieldTable},
};
use serde::Serialize;

use super::{AdminError, Mode, QueueDepth, close_channel, connect_broker, queue_depth};

use crate::topology::{RECEIPT_ROUTING_KEY, Topology};

mod describe;

pub use self::describe::summarize;
use self::describe::*;

/// Most messages one listing holds unacknowledged.
pub const MAX_LIST: u32 = 1000;
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// One dead-lettered message, as listed.
#[derive(Clone, Debug, Serialize)]
pub struct DeadLetter {
    pub message_id: Option<String>,
    /// The `x-job-name` header the enqueuer sets.
    pub job_name: Option<String>,
    pub routing_key: String,
    /// When the job was staged (the `timestamp` property the enqueuer sets).
    pub published_at: Option<DateTime<Utc>>,
    /// The most recent `x-death` entry: why and how often it was dead-lettered.
    pub death: Option<Death>,
    /// Deliveries counted by the quorum queue (`x-delivery-count`), if the broker set it.
    pub delivery_count: Option<i64>,
    /// What the body is: the receipt's ride, user, amount and charge, or why it does not decode.
    pub summary: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Death {
    /// `rejected` (the receipt worker refused it: malformed, unknown ride, permanent SMTP
    /// failure), `delivery_limit` (temporary failures until the limit), `expired`, `maxlen`.
    pub reason: Option<String>,
    pub count: Option<i64>,
    pub queue: Option<String>,
    pub time: Option<DateTime<Utc>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeadLetterList {
    pub queue: QueueDepth,
    pub shown: usize,
    pub messages: Vec<DeadLetter>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RequeueReport {
    pub mode: Mode,
    pub from_queue: String,
    pub to_exchange: String,
    pub routing_key: &'static str,
    /// Dead-letter queue depth when the command started.
    pub dead_letter_depth_before: u32,
    /// Moved (dry run: would be moved).
    pub moved: u64,
    /// Dry run: the messages that would be moved. Applied: the messages moved.
    pub messages: Vec<DeadLetter>,
    /// Dead-letter queue depth at the end.
    pub dead_letter_depth_after: u32,
    /// Why the requeue stopped before the end, if it did (the command then exits non-zero).
    pub stopped: Option<String>,
}

/// `dead-letters list`: up to `limit` messages, left in the queue.
pub async fn list(
    amqp_url: &str,
    topology: &Topology,
    limit: u32,
) -> Result<DeadLetterList, AdminError> {
    if limit == 0 || limit > MAX_LIST {
        return Err(AdminError::Invalid(format!(
            "--limit must be between 1 and {MAX_LIST}"
        )));
    }
    let connection = connect_broker(amqp_url).await?;
    let result = async {
        let depth = queue_depth(&connection, &topology.dead_letter_queue).await?;
        let channel = connection.create_channel().await?;
        let messages = peek(&channel, &topology.dead_letter_queue, limit).await;
        close_channel(&channel).await;
        let messages = messages?;
        Ok(DeadLetterList {
            queue: depth,
            shown: messages.len(),
            messages,
        })
    }
    .await;
    let _ = connection.close(200, "bye".into()).await;
    result
}

/// Takes up to `limit` messages unacknowledged, then returns them all to the queue.
async fn peek(channel: &Channel, queue: &str, limit: u32) -> Result<Vec<DeadLetter>, AdminError> {
    let mut messages = Vec::new();
    let mut last_tag: Option<DeliveryTag> = None;
    let taken = async {
        while messages.len() < limit as usize {
            let Some(message) = channel
                .basic_get(queue.into(), BasicGetOptions { no_ack: false })
                .await?
            else {
                break;
            };
            last_tag = Some(message.delivery.delivery_tag);
            messages.push(describe(&message.delivery));
        }
        Ok::<(), AdminError>(())
    }
    .await;
    // nack, not reject: it says "not processed", which quorum queues (RabbitMQ 4.3+) do not
    // count as a failed delivery. On any error the channel's closing returns them as well.
    if let Some(tag) = last_tag {
        channel
            .basic_nack(
                tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            )
            .await?;
    }
    taken?;
    Ok(messages)
}

/// `dead-letters requeue`: moves up to `limit` messages (default: as many as the queue held when
/// the command started, so a message that fails again at once is not cycled) to the receipts
/// queue. A dry run lists what would be moved and leaves everything in place.
pub async fn requeue(
    amqp_url: &str,
    topology: &Topology,
    limit: Option<u32>,
    mode: Mode,
) -> Result<RequeueReport, AdminError> {
    if limit == Some(0) {
        return Err(AdminError::Invalid("--limit must be at least 1".into()));
    }
    let connection = connect_broker(amqp_url).await?;
    let result = async {
        let before = queue_depth(&connection, &topology.dead_letter_queue).await?;
        // The destination must exist before anything is taken off the dead-letter queue.
        queue_depth(&connection, &topology.receipts_queue).await?;
        let budget = limit.map_or(before.messages, |limit| limit.min(before.messages));
        let mut report = RequeueReport {
            mode,
            from_queue: topology.dead_letter_queue.clone(),
            to_exchange: topology.exchange.clone(),
            routing_key: RECEIPT_ROUTING_KEY,
            dead_letter_depth_before: before.messages,
            moved: 0,
            messages: Vec::new(),
            dead_letter_depth_after: before.messages,
            stopped: None,
        };
        let channel = connection.create_channel().await?;
        let done = async {
            if mode.applies() {
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                move_messages(&channel, topology, budget, &mut report).await?;
            } else if budget > 0 {
                report.messages =
                    peek(&channel, &topology.dead_letter_queue, budget.min(MAX_LIST)).await?;
                report.moved = report.messages.len() as u64;
            }
            Ok::<(), AdminError>(())
        }
        .await;
        close_channel(&channel).await;
        done?;
        report.dead_letter_depth_after = queue_depth(&connection, &topology.dead_letter_queue)
            .await?
            .messages;
        Ok(report)
    }
    .await;
    let _ = connection.close(200, "bye".into()).await;
    result
}

async fn move_messages(
    channel: &Channel,
    topology: &Topology,
    budget: u32,
    report: &mut RequeueReport,
) -> Result<(), AdminError> {
    for _ in 0..budget {
        let Some(message) = channel
            .basic_get(
                topology.dead_letter_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?
        else {
            break;
        };
        let delivery = message.delivery;
        match republish(channel, topology, &delivery).await {
            Ok(()) => {
                delivery.acker.ack(BasicAckOptions::default()).await?;
                report.moved += 1;
                let described = describe(&delivery);
                tracing::info!(
                    message_id = described.message_id.as_deref(),
                    "admin: dead letter requeued"
                );
                report.messages.push(described);
            }
            Err(reason) => {
                delivery
                    .acker
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await?;
                let message_id = describe(&delivery).message_id.unwrap_or_default();
                report.stopped = Some(format!(
                    "stopped after {} moved: message {message_id:?} was not requeued ({reason}); \
                     it stays in {}",
                    report.moved, topology.dead_letter_queue
                ));
                break;
            }
        }
    }
    Ok(())
}

/// Publishes the copy and waits for the broker to confirm it as routed.
async fn republish(
    channel: &Channel,
    topology: &Topology,
    delivery: &Delivery,
) -> Result<(), String> {
    let confirm = channel
        .basic_publish(
            topology.exchange.as_str().into(),
            RECEIPT_ROUTING_KEY.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &delivery.data,
            requeue_properties(&delivery.properties),
        )
        .await
        .map_err(|error| format!("publish failed: {error}"))?;
    match tokio::time::timeout(CONFIRM_TIMEOUT, confirm).await {
        Ok(Ok(Confirmation::Ack(None))) => Ok(()),
        Ok(Ok(Confirmation::Ack(Some(returned)))) => Err(format!(
            "unroutable: the broker returned it ({} {}); is {} bound to {} with {RECEIPT_ROUTING_KEY}?",
            returned.reply_code, returned.reply_text, topology.receipts_queue, topology.exchange
        )),
        Ok(Ok(Confirmation::Nack(_))) => Err(format!(
            "the broker refused it (is {} full? it rejects publishes when over its length limit)",
            topology.receipts_queue
        )),
        Ok(Ok(Confirmation::NotRequested)) => Err("publish was not confirmed".to_owned()),
        Ok(Err(error)) => Err(format!("confirm failed: {error}")),
        Err(_) => Err(format!("no confirm within {CONFIRM_TIMEOUT:?}")),
    }
}

/// The original properties (message_id, content_type, timestamp, application headers such as
/// `x-job-name` and the trace context), persistent, without the broker's dead-letter headers.
pub fn requeue_properties(original: &BasicProperties) -> BasicProperties {
    let mut headers = FieldTable::default();
    if let Some(original_headers) = original.headers() {
        for (name, value) in original_headers {
            if !BROKER_HEADERS.contains(&name.as_str()) {
                headers.insert(name.clone(), value.clone());
            }
        }
    }
    original.clone().with_headers(headers).with_delivery_mode(2)
}

impl DeadLetterList {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{}: {} message(s), {} consumer(s); showing {} (left in the queue)",
            self.queue.queue, self.queue.messages, self.queue.consumers, self.shown
        );
        for message in &self.messages {
            let _ = writeln!(out, "  {}", dead_letter_line(message));
        }
        out
    }
}

impl RequeueReport {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let mut out = String::new();
        match self.mode {
            Mode::DryRun => {
                let _ = writeln!(
                    out,
                    "dead-letters requeue: DRY RUN, nothing moved. Would move {} of {} message(s) \
                     from {} to exchange {} with routing key {}:",
                    self.moved,
                    self.dead_letter_depth_before,
                    self.from_queue,
                    self.to_exchange,
                    self.routing_key
                );
            }
            Mode::Apply => {
                let _ = writeln!(
                    out,
                    "dead-letters requeue: APPLIED. Moved {} message(s) from {} to exchange {} with \
                     routing key {}:",
                    self.moved, self.from_queue, self.to_exchange, self.routing_key
                );
            }
        }
        for message in &self.messages {
            let _ = writeln!(out, "  {}", dead_letter_line(message));
        }
        let _ = writeln!(
            out,
            "{}: {} message(s) before, {} now",
            self.from_queue, self.dead_letter_depth_before, self.dead_letter_depth_after
        );
        if let Some(stopped) = &self.stopped {
            let _ = writeln!(out, "STOPPED: {stopped}");
        }
        if self.mode == Mode::DryRun && self.moved > 0 {
            let _ = writeln!(out, "Re-run with --yes to move them.");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldArray, LongString, ShortString};

    use super::{describe::*, *};

    #[test]
    fn requeue_properties_drop_only_the_brokers_headers() {
        let mut death = FieldTable::default();
        death.insert(
            ShortString::from("reason"),
            AMQPValue::LongString(LongString::from("rejected")),
        );
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-death"),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        headers.insert(
            ShortString::from("x-first-death-reason"),
            AMQPValue::LongString(LongString::from("rejected")),
        );
        headers.insert(
            ShortString::from("x-job-name"),
            AMQPValue::LongString(LongString::from("send_ride_receipt")),
        );
        headers.insert(
            ShortString::from("traceparent"),
            AMQPValue::LongString(LongString::from("00-abc-def-01")),
        );
        let original = BasicProperties::default()
            .with_message_id("42".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(1)
            .with_headers(headers);
        let copy = requeue_properties(&original);
        assert_eq!(copy.message_id().as_ref().unwrap().as_str(), "42");
        assert_eq!(
            copy.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(*copy.delivery_mode(), Some(2));
        let kept: Vec<&str> = copy
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .keys()
            .map(|name| name.as_str())
            .collect();
        assert_eq!(kept, ["traceparent", "x-job-name"]);
    }

    #[test]
    fn summaries_never_echo_undecodable_values() {
        let receipt = serde_json::json!({
            "version": 1, "type": "ride.receipt", "ride_id": 7, "user_id": 3,
            "charge_id": "pi_123", "amount": 2000, "currency": "usd",
            "created_at": "2026-11-21T09:00:00Z"
        });
        assert_eq!(
            summarize(receipt.to_string().as_bytes()),
            "receipt v1: ride 7 user 3 2000 usd charge pi_123"
        );
        let foreign = serde_json::json!({"email": "rider@example.com", "token": "rr_secret"});
        let summary = summarize(foreign.to_string().as_bytes());
        assert!(summary.starts_with("undecodable"), "{summary}");
        assert!(summary.contains("fields [email,token]"), "{summary}");
        assert!(!summary.contains("rider@example.com"), "{summary}");
        assert!(!summary.contains("rr_secret"), "{summary}");
        assert!(summarize(b"\xff\xfe").starts_with("undecodable"));
        assert_eq!(
            scrub_emails("bad rider@example.com here"),
            "bad r***@example.com here"
        );
    }
}
