//! Publishing a batch with publisher confirms: each job encoded by the job registry, with the
//! trace context it was staged under, and what the broker confirmed, returned or refused.

use std::time::Duration;

use lapin::{
    BasicProperties, Channel, Confirmation, PublisherConfirm,
    options::BasicPublishOptions,
    types::{AMQPValue, FieldTable, LongString, ShortString},
};
use schema::models::StagedJob;
use telemetry::semconv::{self, attribute};

use crate::{jobs::Registry, topology::Topology};

use super::*;

pub(super) struct Published {
    pub(super) confirmed: Vec<i64>,
    /// Returned or nacked, with why: these are set aside.
    pub(super) refused: Vec<(i64, String)>,
    pub(super) returned: u64,
    pub(super) nacked: u64,
    pub(super) error: Option<EnqueueError>,
}

/// Publishes every job, then collects the confirms. Publishing all before awaiting any keeps
/// the batch pipelined (one round trip, not one per job).
pub(super) async fn publish_all(
    channel: &Channel,
    topology: &Topology,
    jobs: &[StagedJob],
    confirm_timeout: Duration,
) -> Published {
    let mut published = Published {
        confirmed: Vec::with_capacity(jobs.len()),
        refused: Vec::new(),
        returned: 0,
        nacked: 0,
        error: None,
    };
    let pending = send_all(channel, topology, jobs, &mut published).await;
    let (acked, returns) = await_confirms(pending, confirm_timeout, &mut published).await;
    settle_acked(acked, &returns, &mut published);
    published
}

/// Sends every job (mandatory, so an unroutable one comes back), stopping at the first channel
/// error; the confirms still to come, by job id.
async fn send_all(
    channel: &Channel,
    topology: &Topology,
    jobs: &[StagedJob],
    published: &mut Published,
) -> Vec<(i64, PublisherConfirm)> {
    let exchange = topology.exchange.as_str();
    let mut pending = Vec::with_capacity(jobs.len());
    for job in jobs {
        let (routing_key, body) = encode(job, &topology.jobs);
        let result = channel
            .basic_publish(
                exchange.into(),
                routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &body,
                properties(job, exchange, &routing_key),
            )
            .await;
        match result {
            Ok(confirm) => pending.push((job.id, confirm)),
            Err(error) => {
                published.error = Some(error.into());
                break;
            }
        }
    }
    pending
}

/// Awaits every confirm within one deadline: the acked job ids and the messages returned with
/// them; nacks and unconfirmed publishes are set aside, a failed or late confirm is the batch's
/// error (its job stays staged as it is).
async fn await_confirms(
    pending: Vec<(i64, PublisherConfirm)>,
    confirm_timeout: Duration,
    published: &mut Published,
) -> (Vec<i64>, Returns) {
    let deadline = tokio::time::Instant::now() + confirm_timeout;
    let mut acked = Vec::with_capacity(pending.len());
    let mut returns = Returns::default();
    for (job_id, confirm) in pending {
        match tokio::time::timeout_at(deadline, confirm).await {
            Ok(Ok(Confirmation::Ack(returned))) => {
                acked.push(job_id);
                if let Some(returned) = returned {
                    returns.add_message(job_id, &returned);
                }
            }
            Ok(Ok(Confirmation::Nack(_))) => {
                published.nacked += 1;
                tracing::warn!(job_id, "broker refused job; it stays staged, set aside");
                published
                    .refused
                    .push((job_id, "nacked by the broker".to_owned()));
            }
            Ok(Ok(Confirmation::NotRequested)) => {
                // Cannot happen on a confirm-mode channel; without a confirm nothing is known.
                published.nacked += 1;
                tracing::error!(
                    job_id,
                    "publish was not confirmed; it stays staged, set aside"
                );
                published.refused.push((job_id, "not confirmed".to_owned()));
            }
            Ok(Err(error)) => {
                if published.error.is_none() {
                    published.error = Some(error.into());
                }
            }
            Err(_) => {
                if published.error.is_none() {
                    published.error = Some(EnqueueError::ConfirmTimeout(confirm_timeout));
                }
            }
        }
    }
    (acked, returns)
}

/// An acked job is published unless the broker returned it: routed to at least one queue and
/// accepted is the only case that deletes the job.
fn settle_acked(acked: Vec<i64>, returns: &Returns, published: &mut Published) {
    for job_id in acked {
        match returns.of(job_id) {
            None => published.confirmed.push(job_id),
            Some(reason) => {
                published.returned += 1;
                tracing::warn!(
                    job_id,
                    %reason,
                    "job returned as unroutable; it stays staged, set aside"
                );
                published.refused.push((job_id, reason));
            }
        }
    }
}

/// The messages the broker returned as unroutable, by the job they carry. A `basic.return` has
/// no delivery tag: the client hands it to whichever ack it processes next, which with acks
/// that confirm several publishes at once is not always the returned message's own (a returned
/// job once counted as published, and deleted, while a routed one was set aside). The message id
/// the enqueuer gives every message (the job's id) says whose it is; a return without one makes
/// every ack of the batch doubtful, and a doubtful job stays staged (published again later, which
/// the consumers' deduplication absorbs) rather than be deleted unpublished.
#[derive(Default)]
struct Returns {
    by_job: std::collections::HashMap<i64, String>,
    unidentified: Option<String>,
}

impl Returns {
    fn add_message(&mut self, carried_by: i64, returned: &lapin::message::BasicReturnMessage) {
        let job = returned
            .properties
            .message_id()
            .as_ref()
            .and_then(|id| id.as_str().parse::<i64>().ok());
        let reason = format!("returned {} {}", returned.reply_code, returned.reply_text);
        self.add(carried_by, job, reason);
    }

    /// A return carrying the message of `job` (`None`: a message without a job id), handed to
    /// the ack of `carried_by`.
    fn add(&mut self, carried_by: i64, job: Option<i64>, reason: String) {
        match job {
            Some(job) => {
                self.by_job.insert(job, reason);
            }
            None => {
                tracing::error!(
                    carried_by,
                    "a returned message carries no job id; every job of its batch stays staged"
                );
                self.unidentified = Some(reason);
            }
        }
    }

    /// Why `job` was not routed, if it was returned (or might have been).
    fn of(&self, job: i64) -> Option<String> {
        self.by_job
            .get(&job)
            .or(self.unidentified.as_ref())
            .cloned()
    }
}

/// The routing key and body of a job, by the job registry ([`crate::jobs`]). Args that do not
/// fit their type's message are published as they are, so that the consumer rejects them into the
/// dead-letter queue where a person sees them, instead of blocking the drain. Unknown job names
/// are routed by name: with no queue bound they are returned and set aside.
pub(super) fn encode(job: &StagedJob, registry: &Registry) -> (String, Vec<u8>) {
    let raw = || job.job_args.to_string().into_bytes();
    let Some(kind) = registry.find(&job.job_name) else {
        return (job.job_name.clone(), raw());
    };
    let body = (kind.encode)(&job.job_args).unwrap_or_else(|| {
        tracing::error!(
            job_id = job.id,
            job_name = kind.job_name,
            "job args do not fit the message contract"
        );
        raw()
    });
    (kind.routing_key.to_owned(), body)
}

/// The message's properties. Its headers carry the trace context of a `publish` span that
/// continues the trace the job was staged under, so the consumer's span joins the same trace.
pub(super) fn properties(job: &StagedJob, exchange: &str, routing_key: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("x-job-name"),
        AMQPValue::LongString(LongString::from(job.job_name.as_str())),
    );
    let staged_under: std::collections::HashMap<String, String> = job
        .trace_context
        .as_object()
        .map(|context| {
            context
                .iter()
                .filter_map(|(name, value)| Some((name.clone(), value.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    let span = tracing::info_span!(
        "publish",
        otel.name = %semconv::messaging_span_name(semconv::RABBITMQ_PUBLISH, exchange),
        otel.kind = "producer",
        { attribute::MESSAGING_SYSTEM } = semconv::MESSAGING_SYSTEM_RABBITMQ,
        { attribute::MESSAGING_OPERATION_NAME } = semconv::RABBITMQ_PUBLISH,
        { attribute::MESSAGING_OPERATION_TYPE } = semconv::MESSAGING_OPERATION_SEND,
        { attribute::MESSAGING_DESTINATION_NAME } = exchange,
        { attribute::MESSAGING_RABBITMQ_DESTINATION_ROUTING_KEY } = routing_key,
        // The AMQP message id (a string), which is the staged job's id.
        { attribute::MESSAGING_MESSAGE_ID } = %job.id,
        trace_id = tracing::field::Empty,
    );
    telemetry::continue_trace(&span, &telemetry::MapExtractor(&staged_under));
    let mut carried = span.in_scope(telemetry::inject_current);
    if !carried.contains_key("traceparent") {
        // No OpenTelemetry layer is installed (a library user, a test): pass the staged context
        // on unchanged rather than drop it.
        carried = staged_under
            .into_iter()
            .filter(|(name, _)| name == "traceparent" || name == "tracestate")
            .collect();
    }
    for (name, value) in carried {
        headers.insert(
            ShortString::from(name.as_str()),
            AMQPValue::LongString(LongString::from(value.as_str())),
        );
    }
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(job.id.to_string().into())
        .with_timestamp(u64::try_from(job.created_at.timestamp()).unwrap_or(0))
        .with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::Returns;

    #[test]
    fn a_return_counts_against_the_job_it_carries_not_the_ack_it_came_with() {
        let mut returns = Returns::default();
        // Job 65's return handed to job 64's ack (acks confirming several publishes at once).
        returns.add(64, Some(65), "returned 312 NO_ROUTE".to_owned());
        assert_eq!(returns.of(64), None, "64 was routed: published");
        assert_eq!(returns.of(65).as_deref(), Some("returned 312 NO_ROUTE"));
        assert_eq!(returns.of(66), None);
    }

    #[test]
    fn a_return_without_a_job_id_keeps_every_job_of_the_batch_staged() {
        let mut returns = Returns::default();
        returns.add(64, None, "returned 312 NO_ROUTE".to_owned());
        for job in [64, 65, 66] {
            assert!(returns.of(job).is_some(), "job {job} stays staged");
        }
    }
}
