//! What the clients saw around each `--ha` fault, per kind of call: the outage after
//! every fault, and its spread over the faults of one class (primary kills, planned switchovers,
//! broker-node kills). The report prints both; `invariants::failover` judges them.

use std::{collections::BTreeMap, time::Duration};

use crate::{
    counters::{CallKind, FaultEvent, Outage, Timeline},
    faults::{BROKER_KILL, PRIMARY_KILL, SWITCHOVER},
};

/// How long after a fault healed its outage is still looked for (unless the next fault comes
/// first), so that a failure is counted against at most one fault.
const HORIZON: Duration = Duration::from_secs(30);

/// One fault and what the clients saw after it.
pub(crate) struct FaultOutage {
    pub(crate) event: FaultEvent,
    pub(crate) class: FaultClass,
    /// Since the first fault of the run.
    pub(crate) at: Duration,
    pub(crate) outage: Outage,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum FaultClass {
    PrimaryKill,
    Switchover,
    BrokerKill,
}

impl FaultClass {
    /// The class of a fault from its timeline label (`faults::ha::HaFaults`).
    fn of(label: &str) -> Option<FaultClass> {
        if label == PRIMARY_KILL {
            Some(FaultClass::PrimaryKill)
        } else if label == SWITCHOVER {
            Some(FaultClass::Switchover)
        } else if label.starts_with(BROKER_KILL) {
            Some(FaultClass::BrokerKill)
        } else {
            None
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            FaultClass::PrimaryKill => "primary SIGKILL",
            FaultClass::Switchover => "planned switchover",
            FaultClass::BrokerKill => "RabbitMQ node SIGKILL",
        }
    }
}

/// Every fault of the run in order, each with the outage up to the next fault or [`HORIZON`]
/// after it healed, whichever is first.
pub(crate) fn per_fault(timeline: &Timeline) -> Vec<FaultOutage> {
    let mut events = timeline.events();
    events.sort_by_key(|event| event.at);
    let Some(first) = events.first().map(|event| event.at) else {
        return Vec::new();
    };
    events
        .iter()
        .enumerate()
        .filter_map(|(i, event)| {
            let class = FaultClass::of(&event.label)?;
            let horizon = event.healed + HORIZON;
            let until = events
                .get(i + 1)
                .map_or(horizon, |next| next.at.min(horizon));
            Some(FaultOutage {
                event: event.clone(),
                class,
                at: event.at - first,
                outage: timeline.outage(event, until),
            })
        })
        .collect()
}

/// The spread of one kind of call's unavailability over the faults of one class.
#[derive(Clone, Copy, Default)]
pub(crate) struct Spread {
    pub(crate) faults: usize,
    pub(crate) p50: Duration,
    /// Nearest rank: with fewer than 100 faults, the worst but one only from 100 on.
    pub(crate) p99: Duration,
    pub(crate) max: Duration,
    pub(crate) failed_attempts: usize,
}

impl Spread {
    pub(crate) fn of(mut durations: Vec<Duration>, failed_attempts: usize) -> Spread {
        durations.sort();
        let rank = |q: f64| {
            let n = durations.len();
            let i = ((q * n as f64).ceil() as usize).clamp(1, n.max(1)) - 1;
            durations.get(i).copied().unwrap_or_default()
        };
        Spread {
            faults: durations.len(),
            p50: rank(0.5),
            p99: rank(0.99),
            max: durations.last().copied().unwrap_or_default(),
            failed_attempts,
        }
    }
}

/// Per class of fault, per kind of call: the spread of the unavailability.
pub(crate) fn spread(rows: &[FaultOutage]) -> BTreeMap<FaultClass, BTreeMap<CallKind, Spread>> {
    let mut by_class: BTreeMap<FaultClass, Vec<&FaultOutage>> = BTreeMap::new();
    for row in rows {
        by_class.entry(row.class).or_default().push(row);
    }
    by_class
        .into_iter()
        .map(|(class, rows)| {
            let by_kind = CallKind::ALL
                .into_iter()
                .map(|kind| {
                    let seen = rows.iter().filter_map(|row| row.outage.by_kind.get(&kind));
                    let durations = seen.clone().map(|u| u.unavailable).collect();
                    let failed = seen.map(|u| u.failed_attempts).sum();
                    (kind, Spread::of(durations, failed))
                })
                .collect();
            (class, by_kind)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|m| Duration::from_millis(*m))
                .collect::<Vec<_>>()
        };
        let twenty: Vec<u64> = (1..=20).map(|i| i * 100).collect();
        let spread = Spread::of(ms(&twenty), 7);
        assert_eq!(spread.faults, 20);
        assert_eq!(spread.p50, Duration::from_millis(1000));
        assert_eq!(spread.p99, Duration::from_millis(2000));
        assert_eq!(spread.max, Duration::from_millis(2000));
        assert_eq!(spread.failed_attempts, 7);
        let hundred: Vec<u64> = (1..=100).collect();
        assert_eq!(Spread::of(ms(&hundred), 0).p99, Duration::from_millis(99));
        assert_eq!(Spread::of(Vec::new(), 0).p99, Duration::ZERO);
    }

    #[test]
    fn fault_classes_follow_the_timeline_labels() {
        assert_eq!(FaultClass::of(PRIMARY_KILL), Some(FaultClass::PrimaryKill));
        assert_eq!(FaultClass::of(SWITCHOVER), Some(FaultClass::Switchover));
        assert_eq!(
            FaultClass::of(&format!("{BROKER_KILL} 2")),
            Some(FaultClass::BrokerKill)
        );
        assert_eq!(FaultClass::of("sigkill/api-server"), None);
    }
}
