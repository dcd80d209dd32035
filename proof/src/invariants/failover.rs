//! The goals of `--ha`, judged from what the clients saw around each fault
//! (`crate::outages`): enough primary kills to judge; fresh CreateRides unavailable at most
//! [`FRESH_P99`] at p99 and [`FRESH_MAX`] at worst after a primary kill; replays unavailable no
//! longer than fresh work after a primary kill or a broker-node kill. And, in every mode, the
//! replays sent during traffic answered as the first answer.

use std::{collections::BTreeMap, time::Duration};

use crate::{
    args::Args,
    counters::{CallKind, LiveReplays},
    outages::{FaultClass, Spread},
};

use super::Violations;

/// The ids of this file's `--ha` invariants (`super::INVARIANTS` describes them).
pub(crate) const HA_INVARIANTS: [&str; 3] =
    ["ha_primary_kills", "ha_fresh_outage", "ha_replay_outage"];

pub(crate) const FRESH_P99: Duration = Duration::from_secs(5);
pub(crate) const FRESH_MAX: Duration = Duration::from_secs(10);

/// How much longer replays may look unavailable than fresh work before it counts: the measure's
/// resolution. Every client retries with a jittered back-off of up to 2 s, so after a fault each
/// kind recovers at its first retry that finds the system back; with as many replay loops as
/// charging clients, two such first retries are a fraction of that back-off apart by chance
/// alone. A replay path that waited for something fresh work does not (a lock, a cache, a
/// standby) shows up as seconds, far above this.
pub(crate) const REPLAY_SLACK: Duration = Duration::from_secs(1);

/// The classes of fault whose replays are judged against fresh work.
const REPLAYS_JUDGED_AFTER: [FaultClass; 2] = [FaultClass::PrimaryKill, FaultClass::BrokerKill];

/// Checks the `--ha` goals on `spread` (per class of fault, per kind of call); nothing without
/// `--ha`.
pub(crate) fn check(
    args: &Args,
    spread: &BTreeMap<FaultClass, BTreeMap<CallKind, Spread>>,
    v: &mut Violations,
) {
    if !args.ha {
        return;
    }
    let of = |class: FaultClass, kind: CallKind| {
        spread
            .get(&class)
            .and_then(|kinds| kinds.get(&kind))
            .copied()
            .unwrap_or_default()
    };
    let fresh = of(FaultClass::PrimaryKill, CallKind::Fresh);
    if fresh.faults < args.ha_min_primary_kills as usize {
        v.add(
            "ha_primary_kills",
            format!(
                "{} primary kills, fewer than --ha-min-primary-kills {}",
                fresh.faults, args.ha_min_primary_kills
            ),
        );
    }
    if fresh.p99 > FRESH_P99 || fresh.max > FRESH_MAX {
        v.add(
            "ha_fresh_outage",
            format!(
                "fresh CreateRides unavailable {:.1} s at p99 and {:.1} s at worst over {} primary kills (goals {} s, {} s)",
                fresh.p99.as_secs_f64(),
                fresh.max.as_secs_f64(),
                fresh.faults,
                FRESH_P99.as_secs(),
                FRESH_MAX.as_secs()
            ),
        );
    }
    for class in REPLAYS_JUDGED_AFTER {
        let (fresh, replay) = (of(class, CallKind::Fresh), of(class, CallKind::Replay));
        if replay.p99 > fresh.p99 + REPLAY_SLACK || replay.max > fresh.max + REPLAY_SLACK {
            v.add(
                "ha_replay_outage",
                format!(
                    "after {} {}: replays unavailable {:.1} s at p99, {:.1} s at worst; fresh work {:.1} s, {:.1} s",
                    replay.faults,
                    class.label(),
                    replay.p99.as_secs_f64(),
                    replay.max.as_secs_f64(),
                    fresh.p99.as_secs_f64(),
                    fresh.max.as_secs_f64()
                ),
            );
        }
    }
}

/// Every replay sent during traffic got the first answer to the byte, marked as a replay (one
/// that gave up is counted, not judged, as a fresh key that gave up is; under `--rolling`, where
/// every call must be answered, it is a violation of that).
pub(crate) fn check_live_replays(args: &Args, live: &LiveReplays, v: &mut Violations) {
    for problem in live.problems() {
        v.add("live_replay_identical", problem);
    }
    if args.rolling {
        for (outcome, count) in live.outcomes.snapshot() {
            if outcome.starts_with("gave_up/") {
                v.add(
                    "rolling_every_call_answered",
                    format!("{count} replays during traffic ended {outcome}"),
                );
            }
        }
    }
}
