//! The tallies the campaign keeps while it runs, shared by the clients, the fault tasks and the
//! maintenance passes, and read once at the end by the report. A tally is a count by label, so
//! that a new kind of fault or answer needs no new field.

use std::{
    collections::BTreeMap,
    sync::{Arc, atomic::AtomicU64},
    time::{Duration, Instant},
};

#[derive(Default)]
pub(crate) struct Counters {
    map: std::sync::Mutex<BTreeMap<String, u64>>,
}

impl Counters {
    pub(crate) fn add(&self, label: impl Into<String>, n: u64) {
        if let Ok(mut map) = self.map.lock() {
            *map.entry(label.into()).or_default() += n;
        }
    }
    pub(crate) fn snapshot(&self) -> BTreeMap<String, u64> {
        self.map.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

/// Every tally of one run, each shared with the tasks that count into it.
#[derive(Default)]
pub(crate) struct Tallies {
    /// Fault events, by kind (including children that exited on their own).
    pub(crate) faults: Arc<Counters>,
    /// The answer to each client attempt, by code and reason.
    pub(crate) attempts: Arc<Counters>,
    /// The completer's and reaper's passes and what they did.
    pub(crate) maintenance: Arc<Counters>,
    pub(crate) requests: Arc<AtomicU64>,
    pub(crate) retries: Arc<AtomicU64>,
    pub(crate) timeline: Arc<Timeline>,
}

/// When each client attempt was answered and how, and when each key's client stopped, so that
/// an outage can be measured from the clients' side around each fault of `--ha`.
#[derive(Default)]
pub(crate) struct Timeline {
    /// (sent, answered, how)
    attempts: std::sync::Mutex<Vec<(Instant, Instant, Attempted)>>,
    /// Keys whose client stopped without a final answer (left to the completer), and when.
    left: std::sync::Mutex<Vec<Instant>>,
    /// The `--ha` faults, in the order they were injected.
    events: std::sync::Mutex<Vec<FaultEvent>>,
}

/// How an attempt was answered, as far as an outage is concerned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempted {
    /// A final answer (OK or a stored decline).
    Answered,
    /// A retryable failure: UNAVAILABLE, ABORTED, INTERNAL, a cut connection or a timeout.
    Failed,
}

/// One injected `--ha` fault: when, and when the topology was whole again.
#[derive(Clone)]
pub(crate) struct FaultEvent {
    pub(crate) label: String,
    pub(crate) at: Instant,
    pub(crate) healed: Instant,
}

/// What the clients saw around one fault.
pub(crate) struct Outage {
    /// From the first failed attempt after the fault to the first answered one after that
    /// (zero when no attempt failed).
    pub(crate) unavailable: Duration,
    pub(crate) failed_attempts: usize,
    /// Keys whose clients gave up or dropped them in that window: the completer's to finish.
    pub(crate) keys_left: usize,
}

impl Timeline {
    pub(crate) fn attempt(&self, sent: Instant, how: Attempted) {
        if let Ok(mut attempts) = self.attempts.lock() {
            attempts.push((sent, Instant::now(), how));
        }
    }

    pub(crate) fn key_left(&self) {
        if let Ok(mut left) = self.left.lock() {
            left.push(Instant::now());
        }
    }

    pub(crate) fn fault(&self, event: FaultEvent) {
        if let Ok(mut events) = self.events.lock() {
            events.push(event);
        }
    }

    pub(crate) fn events(&self) -> Vec<FaultEvent> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// The outage the clients saw after `event`, looking no further than `until` (the next
    /// fault, or the end of traffic): failures from other faults in that window count too.
    pub(crate) fn outage(&self, event: &FaultEvent, until: Instant) -> Outage {
        let mut window: Vec<(Instant, Instant, Attempted)> = self
            .attempts
            .lock()
            .map(|a| a.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, answered, _)| *answered >= event.at && *answered < until)
            .collect();
        window.sort_by_key(|(_, answered, _)| *answered);
        let first_failed = window.iter().find(|(_, _, how)| *how == Attempted::Failed);
        let (unavailable, failed_attempts) = match first_failed {
            None => (Duration::ZERO, 0),
            Some(&(_, failed_at, _)) => {
                // Recovered: an attempt sent after the failure was seen got a final answer (one
                // sent before it may have been answered from before the fault).
                let recovered = window
                    .iter()
                    .find(|(sent, _, how)| *sent >= failed_at && *how == Attempted::Answered)
                    .map_or(until, |(_, answered, _)| *answered);
                let failed = window
                    .iter()
                    .filter(|(_, answered, how)| {
                        *answered >= failed_at
                            && *answered <= recovered
                            && *how == Attempted::Failed
                    })
                    .count();
                (recovered - failed_at, failed)
            }
        };
        let keys_left = self
            .left
            .lock()
            .map(|left| {
                left.iter()
                    .filter(|at| **at >= event.at && **at < until)
                    .count()
            })
            .unwrap_or(0);
        Outage {
            unavailable,
            failed_attempts,
            keys_left,
        }
    }
}
