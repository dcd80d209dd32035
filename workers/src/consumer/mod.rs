//! The generic consumer of a registered job type's queue: what every job type's worker shares, so
//! that a job type only brings its handler ([`JobHandler`]) and its registration
//! ([`crate::jobs::registry`]).
//!
//! - A long-lived consumer ([`JobConsumer::run`]): `basic.consume` with the prefetch, manual acks,
//!   reconnecting with back-off when the connection is lost (unacked deliveries return to the queue
//!   with it); on shutdown the consumer is cancelled first, then the deliveries in flight finish
//!   and are settled.
//! - A single pass ([`JobConsumer::run_once`]) with `basic.get` until the queue is empty.
//! - Deliveries are handed to the handler in batches (at most [`ConsumerSettings::batch_size`]),
//!   each in its own task: at once when no other batch is in flight, otherwise when full or
//!   [`ConsumerSettings::batch_wait`] after its first delivery; the deliveries in flight are
//!   bounded by the prefetch. A handler that gains nothing from batching runs each job on its own
//!   (the default [`JobHandler::run_batch`]).
//! - Per delivery: a `process` span that continues the trace the job was staged under (the
//!   `traceparent` headers) and links to the publish; the body decoded by the contract type
//!   (`BackgroundJob::from_message`), a body that does not decode dead-lettered; the outcome
//!   settled as its [`Settlement`] says: ack, reject without requeue (→ the dead-letter queue),
//!   or nack with requeue after a back-off of `retry_base_delay · 2^x-delivery-count` (capped),
//!   the quorum queue's delivery limit bounding the retries; and counted
//!   (`rides.jobs.messages` by job and settlement, and the handler's own summary).

mod batch;
mod outcome;
mod stream;

use std::{future::Future, sync::Arc, time::Duration};

use contract::BackgroundJob;
use lapin::{Channel, options::BasicGetOptions};
use tokio_util::sync::CancellationToken;

pub use self::outcome::{JobCounts, JobOutcome};
use crate::{jobs::JobType, topology::Topology};

/// A job type's worker: runs the jobs its queue delivers.
pub trait JobHandler: Send + Sync + 'static {
    /// The contract type this handler runs (its registration names the queue).
    type Job: BackgroundJob + Send + 'static;
    /// What became of one job.
    type Outcome: Settle + Send + Sync + 'static;
    /// Counts of outcomes, of a pass or of a consumer's lifetime.
    type Summary: Tally<Self::Outcome> + Default + Send + 'static;

    /// Runs one delivered job.
    fn run(
        &self,
        job: Delivered<Self::Job>,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Self::Outcome> + Send;

    /// Runs jobs delivered together: one outcome per job, in their order. By default each runs on
    /// its own, all at once; a handler overrides it to share work across the batch.
    fn run_batch(
        &self,
        jobs: Vec<Delivered<Self::Job>>,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Vec<Self::Outcome>> + Send {
        futures_util::future::join_all(jobs.into_iter().map(|job| self.run(job, shutdown)))
    }
}

/// A decoded job with what its delivery says about it.
#[derive(Debug)]
pub struct Delivered<J> {
    pub job: J,
    /// The AMQP `message_id`: the staged job's id, stable across republishing.
    pub message_id: String,
    /// The delivery's `process` span, in the trace the job was staged under: the handler runs
    /// the job's own steps in it.
    pub span: tracing::Span,
}

/// How the broker is told what became of a delivery.
#[derive(Debug, PartialEq, Eq)]
pub enum Settlement<'a> {
    /// Done (or nothing to do): ack.
    Ack,
    /// Will never succeed: reject without requeue, into the dead-letter queue.
    DeadLetter(&'a str),
    /// May succeed later: nack with requeue after a back-off.
    Retry(&'a str),
}

/// A handler's outcome, as the consumer settles it.
pub trait Settle {
    fn settlement(&self) -> Settlement<'_>;
    /// The outcome of a delivery whose body is not this job type's message.
    fn undecodable(reason: String) -> Self;
    /// The outcome of a delivery the handler returned no outcome for (a handler's bug): requeued.
    fn unanswered() -> Self;
}

/// Counts outcomes.
pub trait Tally<O> {
    fn count(&mut self, outcome: &O);
    fn add(&mut self, other: &Self);
}

/// How a consumer takes and settles deliveries (each worker's own variables, e.g.
/// `RECEIPTS_PREFETCH`).
#[derive(Clone, Debug)]
pub struct ConsumerSettings {
    /// Unacknowledged deliveries in flight.
    pub prefetch: u16,
    /// The most deliveries handed to the handler at once (at most the prefetch).
    pub batch_size: u16,
    /// How long a batch may wait to fill while other batches are in flight (none waits when the
    /// consumer is idle).
    pub batch_wait: Duration,
    /// Delay before a temporarily failed delivery is requeued, doubled per redelivery.
    pub retry_base_delay: Duration,
    pub retry_max_delay: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    #[error("RabbitMQ error")]
    Broker(#[from] lapin::Error),
    /// The connection stopped being usable while the consumer waited: lapin does not always end
    /// a consumer's stream, or answer an ack, once its connection is reset.
    #[error("the RabbitMQ connection was lost")]
    ConnectionLost,
    /// A settle (ack, nack, reject) got no answer in time; the delivery returns to the queue with
    /// the connection.
    #[error("settling a delivery got no answer within {0:?}")]
    SettleTimedOut(Duration),
}

/// Takes `H::Job`'s deliveries off its queue and settles them as `H` decides.
pub struct JobConsumer<H> {
    handler: Arc<H>,
    topology: Topology,
    queue: String,
    job_name: &'static str,
    settings: ConsumerSettings,
}

impl<H: JobHandler> JobConsumer<H> {
    pub fn new(handler: Arc<H>, topology: Topology, settings: ConsumerSettings) -> JobConsumer<H> {
        let kind = JobType::of::<H::Job>();
        JobConsumer {
            handler,
            queue: topology.queue_of(&kind),
            job_name: kind.job_name,
            topology,
            settings,
        }
    }

    /// The queue this consumer takes from.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    fn batch_size(&self) -> usize {
        usize::from(
            self.settings
                .batch_size
                .clamp(1, self.settings.prefetch.max(1)),
        )
    }

    /// One pass: takes messages with `basic.get` until the queue is empty, a batch at a time,
    /// settling each. A temporarily failing message is requeued after its back-off and may come
    /// back in the same pass, until it succeeds or the delivery limit dead-letters it.
    pub async fn run_once(&self, channel: &Channel) -> Result<H::Summary, ConsumeError> {
        let mut summary = H::Summary::default();
        let never = CancellationToken::new();
        loop {
            let mut deliveries = Vec::new();
            while deliveries.len() < self.batch_size() {
                let options = BasicGetOptions { no_ack: false };
                match channel
                    .basic_get(self.queue.as_str().into(), options)
                    .await?
                {
                    Some(message) => deliveries.push(message.delivery),
                    None => break,
                }
            }
            if deliveries.is_empty() {
                return Ok(summary);
            }
            let mut failed = None;
            for settled in self.process(deliveries, &never).await {
                match settled {
                    Ok(outcome) => summary.count(&outcome),
                    Err(error) => failed = failed.or(Some(error)),
                }
            }
            if let Some(error) = failed {
                return Err(error);
            }
        }
    }
}
