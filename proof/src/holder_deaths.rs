//! What an api-server's death costs the riders whose keys it held: for every death (a SIGKILL at
//! a random moment, a crash point, a stall past the lock timeout, and with `--ha` a primary kill or
//! switchover, which ends every server's liveness session), the keys with an attempt in flight
//! that failed across it, and the time from the death to each such key's next final answer. The
//! report gives the spread per cause and for the kills together, beside the goal that a killed
//! holder's key is answered within [`KILL_GOAL`] (docs/reliability.md).

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use crate::{
    counters::{TimedAttempt, Timeline},
    faults::{PRIMARY_KILL, SWITCHOVER},
    outages::Spread,
    processes::Arming,
};

/// A killed holder's keys are answered within this at the 99th percentile.
pub(crate) const KILL_GOAL: Duration = Duration::from_secs(5);

/// The deaths of one cause and what they cost.
pub(crate) struct CauseCost {
    pub(crate) cause: String,
    pub(crate) deaths: usize,
    /// From each death to the next final answer of each key it hurt.
    pub(crate) answered: Spread,
    /// Keys hurt whose clients got no final answer afterwards (they gave up or dropped the
    /// call): the completer's to finish.
    pub(crate) unanswered: usize,
}

/// Per cause, then the kills (random SIGKILLs and crash points) together.
pub(crate) struct HolderDeaths {
    pub(crate) by_cause: Vec<CauseCost>,
    pub(crate) kills: CauseCost,
}

/// Every death of the run: the timeline's, the crash points the api-servers logged
/// (`crashes`, as `Arming::crashes` reads them), and the `--ha` failovers.
fn deaths(
    timeline: &Timeline,
    crashes: Vec<(String, Option<SystemTime>)>,
) -> Vec<(Instant, String)> {
    let mut deaths = timeline.deaths();
    let (now, wall_now) = (Instant::now(), SystemTime::now());
    for (point, at) in crashes {
        let Some(ago) = at.and_then(|at| wall_now.duration_since(at).ok()) else {
            continue;
        };
        if let Some(at) = now.checked_sub(ago) {
            deaths.push((at, format!("crash_point/{point}")));
        }
    }
    for event in timeline.events() {
        if event.label == PRIMARY_KILL || event.label == SWITCHOVER {
            deaths.push((event.at, event.label));
        }
    }
    deaths
}

pub(crate) fn measure(timeline: &Timeline, arming: &Arming) -> HolderDeaths {
    measure_deaths(timeline, arming.crashes())
}

fn measure_deaths(timeline: &Timeline, crashes: Vec<(String, Option<SystemTime>)>) -> HolderDeaths {
    let mut by_key: HashMap<Arc<str>, Vec<TimedAttempt>> = HashMap::new();
    for attempt in timeline.attempts() {
        by_key
            .entry(Arc::clone(&attempt.key))
            .or_default()
            .push(attempt);
    }
    let mut costs: BTreeMap<String, (usize, Vec<Duration>, usize)> = BTreeMap::new();
    for (at, cause) in deaths(timeline, crashes) {
        let cost = costs.entry(cause).or_default();
        cost.0 += 1;
        for attempts in by_key.values() {
            let hurt = attempts
                .iter()
                .any(|a| a.failed() && a.sent <= at && a.answered >= at);
            if !hurt {
                continue;
            }
            let next_final = attempts
                .iter()
                .filter(|a| !a.failed() && a.answered > at)
                .map(|a| a.answered)
                .min();
            match next_final {
                Some(answered) => cost.1.push(answered - at),
                None => cost.2 += 1,
            }
        }
    }
    let mut kills = (0, Vec::new(), 0);
    let by_cause = costs
        .into_iter()
        .map(|(cause, (deaths, durations, unanswered))| {
            if is_kill(&cause) {
                kills.0 += deaths;
                kills.1.extend(durations.iter().copied());
                kills.2 += unanswered;
            }
            cost(cause, deaths, durations, unanswered)
        })
        .collect();
    HolderDeaths {
        by_cause,
        kills: cost("kills".to_owned(), kills.0, kills.1, kills.2),
    }
}

fn is_kill(cause: &str) -> bool {
    cause.starts_with("sigkill/") || cause.starts_with("crash_point/")
}

fn cost(cause: String, deaths: usize, durations: Vec<Duration>, unanswered: usize) -> CauseCost {
    CauseCost {
        cause,
        deaths,
        answered: Spread::of(durations, 0),
        unanswered,
    }
}

impl CauseCost {
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "cause": self.cause,
            "deaths": self.deaths,
            "keys_answered": self.answered.faults,
            "keys_unanswered": self.unanswered,
            "p50_secs": self.answered.p50.as_secs_f64(),
            "p99_secs": self.answered.p99.as_secs_f64(),
            "max_secs": self.answered.max.as_secs_f64(),
        })
    }

    pub(crate) fn line(&self) -> String {
        format!(
            "{:<52} {:>4} deaths {:>5} keys: p50 {:>6.2} s  p99 {:>6.2} s  max {:>6.2} s  ({} unanswered)",
            self.cause,
            self.deaths,
            self.answered.faults,
            self.answered.p50.as_secs_f64(),
            self.answered.p99.as_secs_f64(),
            self.answered.max.as_secs_f64(),
            self.unanswered
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::CallKind;

    #[test]
    fn a_death_costs_each_key_it_cut_the_time_to_that_keys_next_final_answer() {
        let timeline = Timeline::default();
        let t0 = Instant::now();
        let s = |secs: f64| t0 + Duration::from_secs_f64(secs);
        let attempt = |key: &str, sent: f64, answered: f64, failed: bool| {
            timeline.push_attempt(TimedAttempt::at(
                key,
                (s(sent), s(answered)),
                CallKind::Fresh,
                failed,
            ));
        };
        // Cut at the death (t = 10), answered 3 s after it by a retry.
        attempt("cut", 9.5, 10.1, true);
        attempt("cut", 10.5, 11.0, true);
        attempt("cut", 12.0, 13.0, false);
        // Answered across the death: on the other server, not hurt.
        attempt("other", 9.0, 10.5, false);
        // Cut, and its client gave up.
        attempt("given_up", 9.9, 10.2, true);
        timeline.death_at(s(10.0), "sigkill/api-server (random moment)");
        let crashed_at = SystemTime::now() - t0.elapsed();
        let deaths = measure_deaths(
            &timeline,
            vec![("charge.before_call".to_owned(), Some(crashed_at))],
        );
        let sigkill = &deaths.by_cause[1];
        assert_eq!(sigkill.cause, "sigkill/api-server (random moment)");
        assert_eq!((sigkill.deaths, sigkill.answered.faults), (1, 1));
        assert_eq!(sigkill.answered.max, Duration::from_secs(3));
        assert_eq!(sigkill.unanswered, 1);
        // The crash at t0 cut nothing.
        assert_eq!(deaths.by_cause[0].cause, "crash_point/charge.before_call");
        assert_eq!(deaths.by_cause[0].answered.faults, 0);
        assert_eq!(deaths.kills.deaths, 2);
        assert_eq!(deaths.kills.answered.p99, Duration::from_secs(3));
    }
}
