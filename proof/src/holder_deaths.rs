//! What an api-server's death costs the riders whose keys it held: for every death (a SIGKILL at
//! a random moment, a crash point, a stall past the lock timeout, and with `--ha` a primary kill or
//! switchover, which ends every server's liveness session), the keys with an attempt in flight
//! on the server that died that failed across it, and the time from the death to each such key's
//! next final answer. The report gives the spread per cause and for the kills together, beside
//! the goal that a killed holder's key is answered within [`KILL_GOAL`] (docs/reliability.md).
//!
//! Only the dead server's attempts count: in a short campaign a crash point fires about once a
//! second, so nearly every attempt failed by another fault (a stall of the other server, a
//! PostgreSQL restart) spans some crash, and counting it there charged that fault's recovery to
//! the crash. Behind the proxy (`--lb`) the clients do not know the server an attempt reached,
//! and every failed attempt across a death counts, as before.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use crate::{
    counters::{Death, TimedAttempt, Timeline},
    faults::{PRIMARY_KILL, SWITCHOVER},
    outages::Spread,
    processes::{Arming, Crash},
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
    /// The keys answered longest after a death, with their attempts: where a tail is read from.
    pub(crate) slowest: Vec<SlowKey>,
}

/// Whether a run met [`KILL_GOAL`]. A run that killed no holder (the rolling deploys: their
/// api-servers end by SIGTERM and drain) cannot tell, and says so rather than "met".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KillGoal {
    Met,
    Missed,
    NotJudged,
}

impl KillGoal {
    /// How the report's text says it.
    pub(crate) fn text(self) -> &'static str {
        match self {
            KillGoal::Met => "met",
            KillGoal::Missed => "MISSED",
            KillGoal::NotJudged => "not judged (no holder was killed in this run)",
        }
    }

    /// `report.json`'s `kill_goal_met`: `null` when not judged.
    pub(crate) fn met(self) -> Option<bool> {
        match self {
            KillGoal::Met => Some(true),
            KillGoal::Missed => Some(false),
            KillGoal::NotJudged => None,
        }
    }
}

impl HolderDeaths {
    /// The kills' keys against [`KILL_GOAL`]. Kills that hurt no key meet it: no key waited.
    pub(crate) fn kill_goal(&self) -> KillGoal {
        if self.kills.deaths == 0 {
            KillGoal::NotJudged
        } else if self.kills.answered.p99 <= KILL_GOAL {
            KillGoal::Met
        } else {
            KillGoal::Missed
        }
    }
}

/// How many of the slowest hurt keys `holder-deaths-slowest.txt` shows.
const SLOWEST: usize = 30;

/// A hurt key, and every attempt at it.
pub(crate) struct SlowKey {
    death: Death,
    answered_after: Duration,
    key: Arc<str>,
    attempts: Vec<TimedAttempt>,
}

/// Every death of the run: the timeline's, the crash points the api-servers logged
/// (`crashes`, as `Arming::crashes` reads them), and the `--ha` failovers.
fn deaths(timeline: &Timeline, crashes: Vec<Crash>) -> Vec<Death> {
    let mut deaths = timeline.deaths();
    let (now, wall_now) = (Instant::now(), SystemTime::now());
    for crash in crashes {
        let Some(ago) = crash.at.and_then(|at| wall_now.duration_since(at).ok()) else {
            continue;
        };
        if let Some(at) = now.checked_sub(ago) {
            deaths.push(Death {
                at,
                cause: format!("crash_point/{}", crash.point),
                server: Some(crash.server),
            });
        }
    }
    for event in timeline.events() {
        if event.label == PRIMARY_KILL || event.label == SWITCHOVER {
            deaths.push(Death {
                at: event.at,
                cause: event.label,
                server: None,
            });
        }
    }
    deaths
}

/// `targets_known`: each attempt's target is the api-server it reached (not with `--lb`).
pub(crate) fn measure(timeline: &Timeline, arming: &Arming, targets_known: bool) -> HolderDeaths {
    measure_deaths(timeline, arming.crashes(), targets_known)
}

fn measure_deaths(timeline: &Timeline, crashes: Vec<Crash>, targets_known: bool) -> HolderDeaths {
    let mut by_key: HashMap<Arc<str>, Vec<TimedAttempt>> = HashMap::new();
    for attempt in timeline.attempts() {
        by_key
            .entry(Arc::clone(&attempt.key))
            .or_default()
            .push(attempt);
    }
    let mut costs: BTreeMap<String, (usize, Vec<Duration>, usize)> = BTreeMap::new();
    let mut slowest: Vec<SlowKey> = Vec::new();
    for death in deaths(timeline, crashes) {
        let (at, server) = (death.at, death.server);
        let cost = costs.entry(death.cause.clone()).or_default();
        cost.0 += 1;
        let on_the_dead = |a: &TimedAttempt| match server {
            Some(server) if targets_known => a.target == server,
            _ => true,
        };
        for (key, attempts) in &by_key {
            let hurt = attempts
                .iter()
                .any(|a| a.failed() && a.sent <= at && a.answered >= at && on_the_dead(a));
            if !hurt {
                continue;
            }
            let next_final = attempts
                .iter()
                .filter(|a| !a.failed() && a.answered > at)
                .map(|a| a.answered)
                .min();
            match next_final {
                Some(answered) => {
                    cost.1.push(answered - at);
                    slowest.push(SlowKey {
                        death: death.clone(),
                        answered_after: answered - at,
                        key: Arc::clone(key),
                        attempts: attempts.clone(),
                    });
                }
                None => cost.2 += 1,
            }
        }
    }
    slowest.sort_by_key(|slow| std::cmp::Reverse(slow.answered_after));
    slowest.truncate(SLOWEST);
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
        slowest,
    }
}

impl HolderDeaths {
    /// `holder-deaths-slowest.txt`: the slowest hurt keys, each attempt's times in seconds from
    /// the death, the server it went to and its outcome.
    pub(crate) fn write_slowest(&self, out_dir: &std::path::Path) -> std::io::Result<()> {
        let secs = |at: Instant, death: Instant| match at.checked_duration_since(death) {
            Some(after) => after.as_secs_f64(),
            None => -death.duration_since(at).as_secs_f64(),
        };
        let mut text = String::new();
        for slow in &self.slowest {
            let server = slow
                .death
                .server
                .map_or("every".to_owned(), |s| s.to_string());
            text.push_str(&format!(
                "{} (server {server}): key {} answered {:.2} s after\n",
                slow.death.cause,
                slow.key,
                slow.answered_after.as_secs_f64()
            ));
            for a in &slow.attempts {
                text.push_str(&format!(
                    "  sent {:+8.2} s  answered {:+8.2} s  server {}  {}\n",
                    secs(a.sent, slow.death.at),
                    secs(a.answered, slow.death.at),
                    a.target,
                    a.outcome()
                ));
            }
        }
        std::fs::write(out_dir.join("holder-deaths-slowest.txt"), text)
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

    /// Deaths at t = 10 s: a SIGKILL of server 0, and a crash of server 1 at t0.
    fn deaths_at_ten(timeline: &Timeline, t0: Instant, targets_known: bool) -> HolderDeaths {
        timeline.death_at(
            t0 + Duration::from_secs(10),
            "sigkill/api-server (random moment)",
            Some(0),
        );
        let crashed_at = SystemTime::now() - t0.elapsed();
        let crash = Crash {
            server: 1,
            point: "charge.before_call".to_owned(),
            at: Some(crashed_at),
        };
        measure_deaths(timeline, vec![crash], targets_known)
    }

    fn attempts(timeline: &Timeline, t0: Instant) {
        let s = |secs: f64| t0 + Duration::from_secs_f64(secs);
        let attempt = |key: &str, target: usize, sent: f64, answered: f64, failed: bool| {
            let mut attempt =
                TimedAttempt::at(key, (s(sent), s(answered)), CallKind::Fresh, failed);
            attempt.target = target;
            timeline.push_attempt(attempt);
        };
        // Cut at the death (t = 10) on the server that died, answered 3 s after it by a retry.
        attempt("cut", 0, 9.5, 10.1, true);
        attempt("cut", 1, 10.5, 11.0, true);
        attempt("cut", 1, 12.0, 13.0, false);
        // Answered across the death: on the other server, not hurt.
        attempt("other", 1, 9.0, 10.5, false);
        // Cut, and its client gave up.
        attempt("given_up", 0, 9.9, 10.2, true);
        // Failed across the death on the other server (another fault): not this death's, and
        // answered 8 s after it.
        attempt("elsewhere", 1, 9.0, 11.0, true);
        attempt("elsewhere", 1, 17.0, 18.0, false);
    }

    fn slowest_keys(deaths: &HolderDeaths) -> Vec<&str> {
        deaths.slowest.iter().map(|slow| &*slow.key).collect()
    }

    #[test]
    fn a_death_costs_each_key_it_cut_on_its_server_the_time_to_that_keys_next_final_answer() {
        let (timeline, t0) = (Timeline::default(), Instant::now());
        attempts(&timeline, t0);
        let deaths = deaths_at_ten(&timeline, t0, true);
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
        assert_eq!(slowest_keys(&deaths), ["cut"]);
        assert_eq!(deaths.kill_goal(), KillGoal::Met);
    }

    #[test]
    fn the_kill_goal_is_judged_only_when_a_holder_was_killed() {
        let (timeline, t0) = (Timeline::default(), Instant::now());
        attempts(&timeline, t0);
        // A run with no death at all: the cut attempts failed of something else.
        let none = measure_deaths(&timeline, Vec::new(), true);
        assert_eq!(none.kills.deaths, 0);
        assert_eq!(none.kill_goal(), KillGoal::NotJudged);
        assert_eq!(none.kill_goal().met(), None);
        // A kill whose hurt key is answered 8 s after it, past the 5 s goal (behind the proxy
        // every failed attempt across the death counts).
        let late = deaths_at_ten(&timeline, t0, false);
        assert_eq!(late.kills.answered.p99, Duration::from_secs(8));
        assert_eq!(late.kill_goal(), KillGoal::Missed);
        assert_eq!(late.kill_goal().met(), Some(false));
    }

    #[test]
    fn behind_the_proxy_every_failed_attempt_across_a_death_counts() {
        let (timeline, t0) = (Timeline::default(), Instant::now());
        attempts(&timeline, t0);
        let deaths = deaths_at_ten(&timeline, t0, false);
        let sigkill = &deaths.by_cause[1];
        assert_eq!((sigkill.deaths, sigkill.answered.faults), (1, 2));
        assert_eq!(sigkill.answered.max, Duration::from_secs(8));
        assert_eq!(slowest_keys(&deaths), ["elsewhere", "cut"]);
    }
}
