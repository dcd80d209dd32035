//! The plain outcome and counts a handler uses when it has nothing of its own to report (the
//! receipt worker has: [`crate::receipts::Disposition`] and its summary).

use serde::Serialize;

use super::{Settle, Settlement, Tally};

/// What became of a job, for handlers without outcomes of their own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobOutcome {
    Done,
    /// Will never succeed: into the dead-letter queue.
    DeadLetter(String),
    /// May succeed later: requeued after a back-off.
    Retry(String),
}

impl Settle for JobOutcome {
    fn settlement(&self) -> Settlement<'_> {
        match self {
            JobOutcome::Done => Settlement::Ack,
            JobOutcome::DeadLetter(reason) => Settlement::DeadLetter(reason),
            JobOutcome::Retry(reason) => Settlement::Retry(reason),
        }
    }

    fn undecodable(reason: String) -> JobOutcome {
        JobOutcome::DeadLetter(reason)
    }

    fn unanswered() -> JobOutcome {
        JobOutcome::Retry("the handler gave no outcome".into())
    }
}

/// Counts of [`JobOutcome`]s (a `--once` summary).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct JobCounts {
    pub received: u64,
    pub done: u64,
    pub dead_lettered: u64,
    pub retried: u64,
}

impl Tally<JobOutcome> for JobCounts {
    fn count(&mut self, outcome: &JobOutcome) {
        self.received += 1;
        match outcome {
            JobOutcome::Done => self.done += 1,
            JobOutcome::DeadLetter(_) => self.dead_lettered += 1,
            JobOutcome::Retry(_) => self.retried += 1,
        }
    }

    fn add(&mut self, other: &JobCounts) {
        self.received += other.received;
        self.done += other.done;
        self.dead_lettered += other.dead_lettered;
        self.retried += other.retried;
    }
}
