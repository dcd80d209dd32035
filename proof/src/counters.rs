//! The tallies the campaign keeps while it runs, shared by the clients, the fault tasks and the
//! maintenance passes, and read once at the end by the report. A tally is a count by label, so
//! that a new kind of fault or answer needs no new field.

use std::{
    collections::BTreeMap,
    sync::{Arc, atomic::AtomicU64},
    time::{Duration, Instant, SystemTime},
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
    /// What the replays sent during traffic got back (`clients::live_replays::replay_loop`).
    pub(crate) live_replays: Arc<LiveReplays>,
}

/// The replays sent during traffic, by outcome (`identical`, `gave_up`, or a problem), and the
/// problems themselves, each naming its key.
#[derive(Default)]
pub(crate) struct LiveReplays {
    pub(crate) outcomes: Counters,
    problems: std::sync::Mutex<Vec<String>>,
}

impl LiveReplays {
    pub(crate) fn problem(&self, outcome: &'static str, what: String) {
        self.outcomes.add(outcome, 1);
        if let Ok(mut problems) = self.problems.lock() {
            problems.push(what);
        }
    }

    pub(crate) fn problems(&self) -> Vec<String> {
        self.problems.lock().map(|p| p.clone()).unwrap_or_default()
    }
}

/// When each client attempt was answered, how and for what kind of call, and when each key's
/// client stopped, so that an outage can be measured from the clients' side around each fault of
/// `--ha`, per kind of call.
#[derive(Default)]
pub(crate) struct Timeline {
    attempts: std::sync::Mutex<Vec<TimedAttempt>>,
    /// Keys whose client stopped without a final answer (left to the completer), and when.
    left: std::sync::Mutex<Vec<Instant>>,
    /// The `--ha` faults, in the order they were injected.
    events: std::sync::Mutex<Vec<FaultEvent>>,
    /// When an api-server died or stopped, and how ([`crate::holder_deaths`]).
    deaths: std::sync::Mutex<Vec<Death>>,
    /// With `--ha`, the primary's busy sessions by state and wait event, and how late the
    /// campaign's runtime woke ([`crate::ha_samples`]).
    db_samples: std::sync::Mutex<Vec<DbSample>>,
    lateness: std::sync::Mutex<Vec<(Instant, Duration)>>,
}

/// The busy sessions of the primary at one moment, by state and wait event.
type DbSample = (Instant, BTreeMap<String, u64>);

/// What a call was, as far as an outage is concerned: the same fault can stop new charges and
/// leave the stored answers readable, or the other way round.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum CallKind {
    /// A new key of a user whose card charges: a ride and a charge to make.
    Fresh,
    /// A key that already had its final answer, sent again (a caller that lost the answer).
    Replay,
    /// A new key of a user whose card is declined: the refusal is the final answer.
    Refusal,
}

impl CallKind {
    pub(crate) const ALL: [CallKind; 3] = [CallKind::Fresh, CallKind::Replay, CallKind::Refusal];

    pub(crate) fn label(self) -> &'static str {
        match self {
            CallKind::Fresh => "fresh",
            CallKind::Replay => "replay",
            CallKind::Refusal => "refusal",
        }
    }
}

#[derive(Clone)]
pub(crate) struct TimedAttempt {
    /// The idempotency key the attempt was for.
    pub(crate) key: Arc<str>,
    /// The api-server it was sent to, as the clients number them (0 `api-server`, 1
    /// `api-server-b`; always 0, the proxy, with `--lb`).
    pub(crate) target: usize,
    pub(crate) sent: Instant,
    pub(crate) answered: Instant,
    kind: CallKind,
    /// `None` for a final answer (OK or a stored decline); for a retryable failure (UNAVAILABLE,
    /// ABORTED, INTERNAL, a cut connection or a timeout) its outcome, `CLIENT/TIMEOUT`, ...: what
    /// a long outage is explained from.
    failure: Option<String>,
}

impl TimedAttempt {
    /// An attempt at `key` sent and answered at `times`, failed or a final answer.
    #[cfg(test)]
    pub(crate) fn at(key: &str, times: (Instant, Instant), kind: CallKind, failed: bool) -> Self {
        TimedAttempt {
            key: Arc::from(key),
            target: 0,
            sent: times.0,
            answered: times.1,
            kind,
            failure: failed.then(|| "UNAVAILABLE/-".to_owned()),
        }
    }

    pub(crate) fn failed(&self) -> bool {
        self.failure.is_some()
    }

    /// Its failure's outcome, or `final` for a final answer.
    pub(crate) fn outcome(&self) -> &str {
        self.failure.as_deref().unwrap_or("final")
    }
}

/// An api-server's death: when, why, and which one (`None`: every one).
#[derive(Clone, Debug)]
pub(crate) struct Death {
    pub(crate) at: Instant,
    pub(crate) cause: String,
    pub(crate) server: Option<usize>,
}

/// One injected `--ha` fault: when, and when the topology was whole again.
#[derive(Clone)]
pub(crate) struct FaultEvent {
    pub(crate) label: String,
    pub(crate) at: Instant,
    /// `at` on the wall clock, to find the fault in the processes' logs.
    pub(crate) at_wall: SystemTime,
    pub(crate) healed: Instant,
}

/// What the clients saw around one fault.
pub(crate) struct Outage {
    /// Every call, whatever its kind.
    pub(crate) all: Unavailability,
    pub(crate) by_kind: BTreeMap<CallKind, Unavailability>,
    /// Keys whose clients gave up or dropped them in that window: the completer's to finish.
    pub(crate) keys_left: usize,
}

/// How long some calls could not get an answer after a fault.
#[derive(Clone, Default)]
pub(crate) struct Unavailability {
    /// The outage's length: its longest episode (see `unavailability`), from a failed attempt
    /// to the first final answer to an attempt sent after that failure (zero when no attempt
    /// failed).
    pub(crate) unavailable: Duration,
    /// The failed attempts of that episode.
    pub(crate) failed_attempts: usize,
    /// Attempts answered (finally or not) in the window: how well the figure is sampled.
    pub(crate) attempts: usize,
    /// From the fault to that episode's first failed attempt.
    pub(crate) first_failure_after: Duration,
    /// The failed attempts of the outage by outcome, and the final answers in it to attempts
    /// sent before it began: together they tell a refusing server from a silent one.
    pub(crate) failures: BTreeMap<String, usize>,
    pub(crate) answered_from_before: usize,
    /// The primary's busy sessions summed over the samples taken during the outage, and how many
    /// samples that is: what the database was doing meanwhile.
    pub(crate) db_busy: BTreeMap<String, u64>,
    pub(crate) db_samples: usize,
    /// The most the campaign's own runtime woke late during the outage.
    pub(crate) own_lateness: Duration,
    /// From the first failure to the recovery, when some attempt failed.
    span: Option<(Instant, Instant)>,
}

impl Timeline {
    /// An attempt at `key`; `failure` is the outcome of an attempt that is not a final answer.
    pub(crate) fn attempt(
        &self,
        key: &Arc<str>,
        target: usize,
        sent: Instant,
        kind: CallKind,
        failure: Option<&str>,
    ) {
        if let Ok(mut attempts) = self.attempts.lock() {
            attempts.push(TimedAttempt {
                key: Arc::clone(key),
                target,
                sent,
                answered: Instant::now(),
                kind,
                failure: failure.map(str::to_owned),
            });
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

    pub(crate) fn db_sample(&self, busy: BTreeMap<String, u64>) {
        if let Ok(mut samples) = self.db_samples.lock() {
            samples.push((Instant::now(), busy));
        }
    }

    pub(crate) fn own_lateness(&self, late: Duration) {
        if let Ok(mut lateness) = self.lateness.lock() {
            lateness.push((Instant::now(), late));
        }
    }

    /// An api-server died (or stopped) now, by `cause`: the one the clients number `server`, or
    /// every one (`None`: a failover ends every server's liveness session).
    pub(crate) fn death(&self, cause: impl Into<String>, server: Option<usize>) {
        self.death_at(Instant::now(), cause, server);
    }

    pub(crate) fn death_at(&self, at: Instant, cause: impl Into<String>, server: Option<usize>) {
        if let Ok(mut deaths) = self.deaths.lock() {
            deaths.push(Death {
                at,
                cause: cause.into(),
                server,
            });
        }
    }

    pub(crate) fn deaths(&self) -> Vec<Death> {
        self.deaths.lock().map(|d| d.clone()).unwrap_or_default()
    }

    #[cfg(test)]
    pub(crate) fn push_attempt(&self, attempt: TimedAttempt) {
        if let Ok(mut attempts) = self.attempts.lock() {
            attempts.push(attempt);
        }
    }

    /// Every attempt so far.
    pub(crate) fn attempts(&self) -> Vec<TimedAttempt> {
        self.attempts.lock().map(|a| a.clone()).unwrap_or_default()
    }

    pub(crate) fn events(&self) -> Vec<FaultEvent> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// The outage the clients saw after `event`, looking no further than `until` (the next
    /// fault, or the end of traffic): failures from other faults in that window count too.
    pub(crate) fn outage(&self, event: &FaultEvent, until: Instant) -> Outage {
        let mut window: Vec<TimedAttempt> = self
            .attempts
            .lock()
            .map(|a| {
                a.iter()
                    .filter(|a| a.answered >= event.at && a.answered < until)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        window.sort_by_key(|a| a.answered);
        // The outage of some attempts, with what the primary and the campaign were doing
        // meanwhile (the samples of its span, which lies in the window).
        let measured = |attempts: &[TimedAttempt]| {
            let last_start = event.healed + EPISODES_START_WITHIN;
            let mut u = unavailability(attempts, event.at, last_start, until);
            let Some((began, ended)) = u.span else {
                return u;
            };
            let during = |at: &Instant| *at >= began && *at <= ended;
            if let Ok(samples) = self.db_samples.lock() {
                for (_, busy) in samples.iter().filter(|(at, _)| during(at)) {
                    u.db_samples += 1;
                    for (label, n) in busy {
                        *u.db_busy.entry(label.clone()).or_default() += n;
                    }
                }
            }
            if let Ok(lateness) = self.lateness.lock() {
                u.own_lateness = lateness
                    .iter()
                    .filter(|(at, _)| during(at))
                    .map(|(_, late)| *late)
                    .max()
                    .unwrap_or_default();
            }
            u
        };
        let by_kind = CallKind::ALL
            .into_iter()
            .map(|kind| {
                let of_kind: Vec<TimedAttempt> =
                    window.iter().filter(|a| a.kind == kind).cloned().collect();
                (kind, measured(&of_kind))
            })
            .collect();
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
            all: measured(&window),
            by_kind,
            keys_left,
        }
    }
}

/// How long after a fault healed an episode of failures may begin and still be the fault's: the
/// clients' last retries into the old topology and their reconnections. One that begins later
/// is another fault's (a crash point, a provider fault), however long the window.
pub(crate) const EPISODES_START_WITHIN: Duration = Duration::from_secs(5);

/// The unavailability seen in `window` (attempts in the order they were answered) after a fault
/// `at`: its longest episode among those that began by `last_start`. An episode runs from a
/// failed attempt to the first final answer to an attempt sent after that failure; the next
/// begins at the next failure answered after it. The longest, not the first, because a window
/// also holds failures the fault did not cause (a crash point, a client's own timeout): a short
/// one of those before the fault took hold would otherwise stand for the outage and hide it.
fn unavailability(
    window: &[TimedAttempt],
    at: Instant,
    last_start: Instant,
    until: Instant,
) -> Unavailability {
    let Some((failed_at, recovered)) = longest_episode(window, last_start, until) else {
        return Unavailability {
            attempts: window.len(),
            ..Unavailability::default()
        };
    };
    let during = || {
        window
            .iter()
            .filter(move |a| a.answered >= failed_at && a.answered <= recovered)
    };
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for failure in during().filter_map(|a| a.failure.as_deref()) {
        *failures.entry(failure.to_owned()).or_default() += 1;
    }
    Unavailability {
        unavailable: recovered - failed_at,
        failed_attempts: failures.values().sum(),
        attempts: window.len(),
        first_failure_after: failed_at.saturating_duration_since(at),
        failures,
        answered_from_before: during()
            .filter(|a| !a.failed() && a.sent < failed_at)
            .count(),
        span: Some((failed_at, recovered)),
        ..Unavailability::default()
    }
}

/// The longest episode of `window` that began by `last_start` (see [`unavailability`]) as
/// (first failure, recovery); the first of equals. An episode still open at the window's end
/// lasts until `until`.
fn longest_episode(
    window: &[TimedAttempt],
    last_start: Instant,
    until: Instant,
) -> Option<(Instant, Instant)> {
    let mut longest: Option<(Instant, Instant)> = None;
    let mut from = 0;
    while let Some(offset) = window[from..].iter().position(TimedAttempt::failed) {
        let start = from + offset;
        let failed_at = window[start].answered;
        if failed_at > last_start {
            break;
        }
        // Recovered: an attempt sent after the failure was seen got a final answer (one sent
        // before it may have been answered from before the fault).
        let recovered = window[start..]
            .iter()
            .find(|a| a.sent >= failed_at && !a.failed())
            .map_or(until, |a| a.answered);
        if longest.is_none_or(|(began, ended)| recovered - failed_at > ended - began) {
            longest = Some((failed_at, recovered));
        }
        from = start + window[start..].partition_point(|a| a.answered <= recovered);
    }
    longest
}

#[cfg(test)]
mod tests;
