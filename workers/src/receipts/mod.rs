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
//! Layout: [`consume`] takes deliveries from the broker and settles each as its [`Disposition`]
//! says; [`send`] decides that disposition in named steps (what the ride is owed, the claim, an
//! earlier attempt's mail, the send); [`claim`] is the `receipt_claims` row that fences
//! attempts; [`summary`] counts outcomes.

mod claim;
mod consume;
mod send;
mod summary;

use std::sync::Arc;

use contract::message::ReceiptMessage;
use schema::{Pool, PoolError};
use tokio_util::sync::CancellationToken;

pub use self::summary::{Disposition, ReceiptSummary};
use crate::{
    config::ReceiptsConfig,
    mailer::{MailError, Mailer},
    relay_search::RelaySearch,
    topology::Topology,
};

#[derive(Debug, thiserror::Error)]
pub enum ReceiptError {
    #[error("RabbitMQ error")]
    Broker(#[from] lapin::Error),
    /// The connection stopped being usable while the consumer waited: lapin does not always end
    /// a consumer's stream, or answer an ack, once its connection is reset.
    #[error("the RabbitMQ connection was lost")]
    ConnectionLost,
    /// A settle (ack, nack, reject) got no answer in time; the delivery returns to the queue with
    /// the connection.
    #[error("settling a delivery got no answer within {0:?}")]
    SettleTimedOut(std::time::Duration),
}

#[derive(Debug, thiserror::Error)]
enum HandleError {
    #[error("no database connection available")]
    Pool(#[from] PoolError),
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
    #[error("{0}")]
    Mail(#[from] MailError),
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

    /// Decides a delivery's fate, sending the mail if it is due.
    pub async fn handle(
        &self,
        body: &[u8],
        message_id: &str,
        shutdown: &CancellationToken,
    ) -> Disposition {
        let message = match ReceiptMessage::decode(body) {
            Ok(message) => message,
            Err(error) => return Disposition::DeadLetter(error.to_string()),
        };
        match self.send_once(&message, message_id, shutdown).await {
            Ok(disposition) => disposition,
            Err(HandleError::Mail(MailError::Permanent(error))) => Disposition::DeadLetter(error),
            Err(error) => Disposition::Retry(error.to_string()),
        }
    }
}
