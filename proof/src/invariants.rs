//! The invariants: exactly-once charging and receipting, checked key by key against what its
//! client saw and the evidence (database, ledger, mail), then globally (no charge, receipt or
//! mail without its ride, every crash point fired). Each violation names its invariant and the
//! offending key, so that one failed run says what broke and where to look.

use std::collections::BTreeMap;

#[derive(Default)]
pub(crate) struct Violations {
    pub(crate) list: Vec<String>,
    pub(crate) by_invariant: BTreeMap<&'static str, u64>,
}

impl Violations {
    pub(crate) fn add(&mut self, invariant: &'static str, what: String) {
        *self.by_invariant.entry(invariant).or_default() += 1;
        if self.list.len() < 500 {
            eprintln!("VIOLATION [{invariant}] {what}");
        }
        self.list.push(format!("[{invariant}] {what}"));
    }
}
