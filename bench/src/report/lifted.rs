//! A run at the production defaults beside its twin with every defence lifted: the ratio of
//! the two, judged against the admission goals.

use crate::ratio::Verdict;

use super::*;

/// A scenario named `X-lifted` is `X` on an api-server with every defence lifted, and `X` is
/// judged against it, so that the defences cost legitimate callers little: throughput at least this fraction of the lifted run's, p99 at
/// most this multiple, and no request failed.
pub const LIFTED_SUFFIX: &str = "-lifted";
pub const LIFTED_THROUGHPUT_GOAL: f64 = 0.9;
pub const LIFTED_P99_GOAL: f64 = 1.5;

#[derive(Clone, Debug, PartialEq)]
pub struct LiftedPair {
    pub scenario: String,
    /// 1-based: with `ROUNDS=n` the k-th run at the defaults is paired with the k-th lifted one.
    pub round: usize,
    pub throughput_ratio: f64,
    pub p99_ratio: f64,
    pub failed: u64,
    pub verdict: Verdict,
}

/// Every run at the defaults beside its lifted twin, in order.
pub fn defaults_vs_lifted(records: &[Record]) -> Vec<LiftedPair> {
    let runs = |name: &str| -> Vec<&LoadgenRecord> {
        records
            .iter()
            .filter_map(|record| match record {
                Record::Loadgen(run) if run.scenario == name => Some(run),
                _ => None,
            })
            .collect()
    };
    let mut names: Vec<&str> = Vec::new();
    for record in records {
        if let Record::Loadgen(run) = record
            && let Some(name) = run.scenario.strip_suffix(LIFTED_SUFFIX)
            && !names.contains(&name)
        {
            names.push(name);
        }
    }
    let mut pairs = Vec::new();
    for name in names {
        let lifted = runs(&format!("{name}{LIFTED_SUFFIX}"));
        for (round, (defaults, lifted)) in runs(name).into_iter().zip(lifted).enumerate() {
            let throughput_ratio = defaults.throughput / lifted.throughput.max(1e-9);
            let p99_ratio = defaults.p99_ms / lifted.p99_ms.max(1e-9);
            let met = throughput_ratio >= LIFTED_THROUGHPUT_GOAL
                && p99_ratio <= LIFTED_P99_GOAL
                && defaults.failed == 0;
            pairs.push(LiftedPair {
                scenario: name.to_owned(),
                round: round + 1,
                throughput_ratio,
                p99_ratio,
                failed: defaults.failed,
                verdict: if met { Verdict::Met } else { Verdict::Missed },
            });
        }
    }
    pairs
}
