//! The tallies the campaign keeps while it runs, shared by the clients, the fault tasks and the
//! maintenance passes, and read once at the end by the report. A tally is a count by label, so
//! that a new kind of fault or answer needs no new field.

use std::{
    collections::BTreeMap,
    sync::{Arc, atomic::AtomicU64},
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
}
