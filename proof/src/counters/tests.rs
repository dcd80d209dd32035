//! The timeline's unit tests: the outage after a fault measured per kind of call, and the longest
//! episode that began while the fault lasted, on attempts and faults made up in memory.

use super::*;

#[derive(Clone, Copy, PartialEq)]
enum Attempted {
    Answered,
    Failed,
}

impl Timeline {
    fn answered_at(&self, sent: Instant, answered: Instant, how: Attempted, kind: CallKind) {
        if let Ok(mut attempts) = self.attempts.lock() {
            attempts.push(TimedAttempt::at(
                "k",
                (sent, answered),
                kind,
                how == Attempted::Failed,
            ));
        }
    }

    fn sampled_at(&self, at: Instant, label: &str, n: u64) {
        if let Ok(mut samples) = self.db_samples.lock() {
            samples.push((at, BTreeMap::from([(label.to_owned(), n)])));
        }
    }
}

fn ms_after(t0: Instant) -> impl Fn(u64) -> Instant {
    move |ms| t0 + Duration::from_millis(ms)
}

fn primary_kill_at_1s(at: &impl Fn(u64) -> Instant) -> FaultEvent {
    FaultEvent {
        label: "failover/postgresql primary SIGKILL".to_owned(),
        at: at(1000),
        at_wall: SystemTime::now(),
        healed: at(5000),
    }
}

#[test]
fn the_outage_is_measured_per_kind_of_call() {
    let (timeline, at) = (Timeline::default(), ms_after(Instant::now()));
    let event = primary_kill_at_1s(&at);
    use Attempted::{Answered, Failed};
    // Fresh: answered before the fault, fails from 1.2 s, a retry sent at 1.1 s (before the
    // failure was seen) answered at 2 s does not end it, one sent at 3 s answered at 3.5 s
    // does.
    timeline.answered_at(at(500), at(900), Answered, CallKind::Fresh);
    timeline.answered_at(at(1100), at(1200), Failed, CallKind::Fresh);
    timeline.answered_at(at(1100), at(2000), Answered, CallKind::Fresh);
    timeline.answered_at(at(2500), at(2600), Failed, CallKind::Fresh);
    timeline.answered_at(at(3000), at(3500), Answered, CallKind::Fresh);
    // Replays: fail once at 1.3 s, answered again at 1.8 s.
    timeline.answered_at(at(1250), at(1300), Failed, CallKind::Replay);
    timeline.answered_at(at(1700), at(1800), Answered, CallKind::Replay);
    // Refusals: never failed.
    timeline.answered_at(at(1400), at(1450), Answered, CallKind::Refusal);
    // The primary: commits waiting on the standby inside the fresh and the replay outages,
    // then nothing busy once both are over.
    timeline.sampled_at(at(1500), "active:IPC/SyncRep", 3);
    timeline.sampled_at(at(2000), "active:IPC/SyncRep", 2);
    timeline.sampled_at(at(4000), "active:-", 1);
    // The campaign's runtime: woke 700 ms late during the fresh outage only.
    if let Ok(mut lateness) = timeline.lateness.lock() {
        lateness.push((at(3200), Duration::from_millis(700)));
        lateness.push((at(4200), Duration::from_millis(900)));
    }

    let outage = timeline.outage(&event, at(10_000));
    let kind = |k: CallKind| outage.by_kind[&k].clone();
    assert_eq!(
        kind(CallKind::Fresh).unavailable,
        Duration::from_millis(2300)
    );
    assert_eq!(kind(CallKind::Fresh).failed_attempts, 2);
    assert_eq!(kind(CallKind::Fresh).attempts, 4);
    assert_eq!(
        kind(CallKind::Fresh).first_failure_after,
        Duration::from_millis(200)
    );
    assert_eq!(
        kind(CallKind::Fresh).failures,
        BTreeMap::from([("UNAVAILABLE/-".to_owned(), 2)])
    );
    // The retry sent at 1.1 s, before the failure at 1.2 s, answered at 2 s.
    assert_eq!(kind(CallKind::Fresh).answered_from_before, 1);
    assert_eq!(kind(CallKind::Fresh).db_samples, 2);
    assert_eq!(
        kind(CallKind::Fresh).db_busy,
        BTreeMap::from([("active:IPC/SyncRep".to_owned(), 5)])
    );
    assert_eq!(kind(CallKind::Replay).db_samples, 1);
    assert_eq!(
        kind(CallKind::Fresh).own_lateness,
        Duration::from_millis(700)
    );
    assert_eq!(kind(CallKind::Replay).own_lateness, Duration::ZERO);
    assert_eq!(kind(CallKind::Refusal).db_samples, 0);
    assert_eq!(
        kind(CallKind::Replay).unavailable,
        Duration::from_millis(500)
    );
    assert_eq!(kind(CallKind::Replay).failed_attempts, 1);
    assert_eq!(kind(CallKind::Refusal).unavailable, Duration::ZERO);
    assert_eq!(kind(CallKind::Refusal).attempts, 1);
    // All calls: two episodes. From the first failure (1.2 s) to the first final answer to
    // an attempt sent after it, the refusal at 1.45 s; then from the fresh failure at 2.6 s
    // to 3.5 s, the longer. Either hides the fresh calls' 2.3 s: what the split by kind is
    // for.
    assert_eq!(outage.all.unavailable, Duration::from_millis(900));
    assert_eq!(outage.all.failed_attempts, 1);
    assert_eq!(outage.all.first_failure_after, Duration::from_millis(1600));
    // A window that ends before the fresh calls recover: unavailable until its end.
    let cut = timeline.outage(&event, at(3000));
    assert_eq!(
        cut.by_kind[&CallKind::Fresh].unavailable,
        Duration::from_millis(1800)
    );
}

#[test]
fn the_outage_is_the_longest_episode_that_began_while_the_fault_lasted() {
    let (timeline, at) = (Timeline::default(), ms_after(Instant::now()));
    let event = primary_kill_at_1s(&at);
    use Attempted::{Answered, Failed};
    // A crash point fails one call at 1.1 s, its retry answered at 1.15 s; the failover then
    // fails every call from 1.5 s until 3.5 s.
    timeline.answered_at(at(1050), at(1100), Failed, CallKind::Fresh);
    timeline.answered_at(at(1110), at(1150), Answered, CallKind::Fresh);
    timeline.answered_at(at(1400), at(1500), Failed, CallKind::Fresh);
    timeline.answered_at(at(2000), at(2300), Failed, CallKind::Fresh);
    timeline.answered_at(at(3000), at(3500), Answered, CallKind::Fresh);
    // Another short one after it, shorter than the outage.
    timeline.answered_at(at(4000), at(4100), Failed, CallKind::Fresh);
    timeline.answered_at(at(4200), at(4300), Answered, CallKind::Fresh);
    // The fault healed at 5 s; a longer one that begins more than 5 s later is another
    // fault's.
    timeline.answered_at(at(10_100), at(10_200), Failed, CallKind::Fresh);
    timeline.answered_at(at(16_000), at(16_100), Answered, CallKind::Fresh);

    let fresh = timeline.outage(&event, at(30_000)).by_kind[&CallKind::Fresh].clone();
    assert_eq!(fresh.unavailable, Duration::from_millis(2000));
    assert_eq!(fresh.first_failure_after, Duration::from_millis(500));
    assert_eq!(fresh.failed_attempts, 2);
    assert_eq!(fresh.attempts, 9);
    // Healed later, it is the fault's.
    let slow_to_heal = FaultEvent {
        healed: at(6000),
        ..primary_kill_at_1s(&at)
    };
    let fresh = timeline.outage(&slow_to_heal, at(30_000)).by_kind[&CallKind::Fresh].clone();
    assert_eq!(fresh.unavailable, Duration::from_millis(5900));
}
