//! What became of deliveries: one [`Disposition`] each, counted in a [`ReceiptSummary`].

use serde::Serialize;

use crate::{
    consumer::{Settle, Settlement, Tally},
    metrics::{self, Handled},
};

/// Counts of one pass or of a loop's lifetime.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReceiptSummary {
    pub received: u64,
    /// Mailed and recorded.
    pub sent: u64,
    /// Already sent for this ride: acked without mailing.
    pub duplicates: u64,
    /// An earlier attempt's mail was found at the relay: recorded and acked without mailing.
    pub recovered: u64,
    /// Mailed although an earlier attempt may have mailed it too, because no relay search is
    /// configured to check (also counted in `sent`).
    pub unverified_resends: u64,
    /// Rejected into the dead-letter queue.
    pub dead_lettered: u64,
    /// Requeued after a temporary failure.
    pub retried: u64,
}

impl ReceiptSummary {
    /// Counts this summary in the worker's metric, by outcome.
    pub(crate) fn record(&self) {
        metrics::count(Handled::Receipts, "sent", self.sent);
        metrics::count(Handled::Receipts, "duplicate", self.duplicates);
        metrics::count(Handled::Receipts, "recovered", self.recovered);
        metrics::count(
            Handled::Receipts,
            "unverified_resend",
            self.unverified_resends,
        );
        metrics::count(Handled::Receipts, "dead_lettered", self.dead_lettered);
        metrics::count(Handled::Receipts, "retried", self.retried);
    }
}

impl Tally<Disposition> for ReceiptSummary {
    fn count(&mut self, disposition: &Disposition) {
        let mut one = ReceiptSummary {
            received: 1,
            ..ReceiptSummary::default()
        };
        match disposition {
            Disposition::Sent { verified: true } => one.sent = 1,
            Disposition::Sent { verified: false } => {
                one.sent = 1;
                one.unverified_resends = 1;
            }
            Disposition::Duplicate => one.duplicates = 1,
            Disposition::Recovered => one.recovered = 1,
            Disposition::DeadLetter(_) => one.dead_lettered = 1,
            Disposition::Retry(_) => one.retried = 1,
        }
        one.record();
        self.add(&one);
    }

    fn add(&mut self, other: &ReceiptSummary) {
        self.received += other.received;
        self.sent += other.sent;
        self.duplicates += other.duplicates;
        self.recovered += other.recovered;
        self.unverified_resends += other.unverified_resends;
        self.dead_lettered += other.dead_lettered;
        self.retried += other.retried;
    }
}

/// What to do with a delivery.
#[derive(Debug)]
pub enum Disposition {
    /// Mailed and recorded. `verified: false` when an earlier attempt may have mailed it too and
    /// no relay search could say.
    Sent {
        verified: bool,
    },
    Duplicate,
    Recovered,
    DeadLetter(String),
    Retry(String),
}

impl Settle for Disposition {
    fn settlement(&self) -> Settlement<'_> {
        match self {
            Disposition::Sent { .. } | Disposition::Duplicate | Disposition::Recovered => {
                Settlement::Ack
            }
            Disposition::DeadLetter(reason) => Settlement::DeadLetter(reason),
            Disposition::Retry(reason) => Settlement::Retry(reason),
        }
    }

    fn undecodable(reason: String) -> Disposition {
        Disposition::DeadLetter(reason)
    }

    fn unanswered() -> Disposition {
        Disposition::Retry("the handler gave no outcome".into())
    }
}
