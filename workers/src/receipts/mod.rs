//! The receipt worker: consumes `ride.receipt` messages with manual acks and mails each rider
//! exactly one receipt per ride.
//!
//! Per delivery:
//! - malformed message, unknown version, unknown ride, a ride that is not the message's user's,
//!   or a ride that records no charge or another charge than the message's → reject without
//!   requeue → dead-letter queue with the reason logged (never retried forever, never mailed: a
//!   receipt is only ever for a charge the ride records);
//! - otherwise the attempt *claims* the ride's receipt: a `receipt_claims` row, committed before
//!   any SMTP traffic, holding an attempt count and a lease. While another attempt's lease runs,
//!   this one waits (a duplicate message, or a redelivery after a crash, never sends in parallel);
//! - with the claim held: a ride already in `sent_receipts` is a duplicate (ack, nothing mailed).
//!   If an earlier attempt claimed the ride before (attempts > 1) it may have handed the mail to
//!   the relay and died before recording it, so the relay is asked for the deterministic
//!   Message-ID first (`MAIL_SEARCH_URL`, [`crate::relay_search`]); found → recorded, not re-sent;
//! - then the mail is sent, and one transaction writes `sent_receipts` and deletes the claim,
//!   then the delivery is acked;
//! - temporary SMTP failure (4xx, connection refused, timeout) → the claim's lease is ended at
//!   once (the next attempt need not wait, and will check the relay), and after a back-off delay
//!   the delivery is nacked with requeue; the quorum queue's delivery limit bounds the retries and
//!   then dead-letters it;
//! - permanent SMTP failure (5xx, invalid address) → the claim is dropped (nothing was accepted)
//!   and the delivery dead-lettered.
//!
//! What is left of the crash window: without `MAIL_SEARCH_URL`, a receipt whose attempt died
//! between the relay's `250` and the commit is sent again (same Message-ID, so the receiving mail
//! system can drop it). Sending again is the deliberate choice over never sending. With the
//! search configured, the relay's own record decides.
//!
//! Layout: the generic consumer ([`crate::consumer`]) takes deliveries of [`ReceiptJob`] from the
//! broker and settles each as its [`Disposition`] says; this module is the job's handler:
//! [`send`] decides that disposition in named steps (what the ride is owed, the claim, an earlier
//! attempt's mail, the send); [`claim`] is the `receipt_claims` row that fences attempts;
//! [`summary`] counts outcomes.

mod batch;
mod claim;
mod claims;
mod send;
mod summary;

use std::sync::Arc;

use contract::ReceiptJob;
use lapin::Channel;
use schema::{Pool, PoolError};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use self::summary::{Disposition, ReceiptSummary};
use crate::{
    config::ReceiptsConfig,
    consumer::{ConsumeError, ConsumerSettings, Delivered, JobConsumer, JobHandler},
    mailer::{MailError, Mailer},
    relay_search::RelaySearch,
    topology::Topology,
};

/// What can stop the receipt consumer: the generic consumer's errors.
pub type ReceiptError = ConsumeError;

#[derive(Debug, thiserror::Error)]
enum HandleError {
    #[error("no database connection available")]
    Pool(#[from] PoolError),
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
    #[error("{0}")]
    Mail(#[from] MailError),
}

impl HandleError {
    /// A permanent mail failure dead-letters the delivery; anything else is worth a retry.
    fn disposition(self) -> Disposition {
        match self {
            HandleError::Mail(MailError::Permanent(error)) => Disposition::DeadLetter(error),
            error => Disposition::Retry(error.to_string()),
        }
    }
}

pub struct ReceiptWorker {
    pool: Pool,
    mailer: Mailer,
    relay_search: Option<RelaySearch>,
    topology: Topology,
    config: ReceiptsConfig,
}

impl ReceiptWorker {
    pub fn new(
        pool: Pool,
        mailer: Mailer,
        relay_search: Option<RelaySearch>,
        topology: Topology,
        config: ReceiptsConfig,
    ) -> Arc<Self> {
        Arc::new(ReceiptWorker {
            pool,
            mailer,
            relay_search,
            topology,
            config,
        })
    }

    /// The receipts queue's consumer, running this handler.
    pub fn consumer(self: &Arc<Self>) -> JobConsumer<ReceiptWorker> {
        let settings = ConsumerSettings {
            prefetch: self.config.prefetch,
            batch_size: self.config.batch_size,
            batch_wait: self.config.batch_wait,
            retry_base_delay: self.config.retry_base_delay,
            retry_max_delay: self.config.retry_max_delay,
        };
        JobConsumer::new(Arc::clone(self), self.topology.clone(), settings)
    }

    /// One pass with `basic.get` until the queue is empty ([`JobConsumer::run_once`]).
    pub async fn run_once(
        self: &Arc<Self>,
        channel: &Channel,
    ) -> Result<ReceiptSummary, ReceiptError> {
        self.consumer().run_once(channel).await
    }

    /// Consumes until `shutdown` ([`JobConsumer::run`]).
    pub async fn run(
        self: Arc<Self>,
        amqp_url: &str,
        shutdown: CancellationToken,
    ) -> ReceiptSummary {
        Arc::new(self.consumer()).run(amqp_url, shutdown).await
    }
}

impl JobHandler for ReceiptWorker {
    type Job = ReceiptJob;
    type Outcome = Disposition;
    type Summary = ReceiptSummary;

    /// Decides a delivery's fate, sending the mail if it is due.
    async fn run(&self, job: Delivered<ReceiptJob>, shutdown: &CancellationToken) -> Disposition {
        let Delivered {
            job,
            message_id,
            span,
        } = job;
        self.send_once(&job, &message_id, shutdown)
            .instrument(span)
            .await
            .unwrap_or_else(HandleError::disposition)
    }

    /// The batch's distinct rides as one batch ([`batch`]); a ride delivered twice in the batch
    /// (a duplicate message) only after its first delivery is done, on its own, so that the
    /// second finds the first's record instead of waiting out its lease.
    async fn run_batch(
        &self,
        jobs: Vec<Delivered<ReceiptJob>>,
        shutdown: &CancellationToken,
    ) -> Vec<Disposition> {
        let mut seen = std::collections::HashSet::new();
        let (first, repeats): (Vec<_>, Vec<_>) = jobs
            .into_iter()
            .enumerate()
            .partition(|(_, delivered)| seen.insert(delivered.job.ride_id));
        let (at, first): (Vec<usize>, Vec<_>) = first.into_iter().unzip();
        let mut outcomes: Vec<(usize, Disposition)> = at
            .into_iter()
            .zip(self.send_batch(first, shutdown).await)
            .collect();
        for (at, delivered) in repeats {
            outcomes.push((at, self.run(delivered, shutdown).await));
        }
        outcomes.sort_by_key(|(at, _)| *at);
        outcomes.into_iter().map(|(_, outcome)| outcome).collect()
    }
}
