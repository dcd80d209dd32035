//! Crash points for the reliability campaign (`proof/`).
//!
//! A crash point is a place where a real crash is most dangerous: just before and just after a
//! phase commits, and between a successful charge and the transaction that records it. The
//! campaign arms one point per api-server process and the process SIGKILLs itself on the n-th time
//! it passes there, so every recovery point is crashed on purpose rather than only when a random
//! kill happens to land on it.
//!
//! Compiled in only with the `fault-injection` feature; without it [`crash_point`] is an empty
//! inline function and the environment variables below are never read. Release images and
//! `deploy/` builds never enable it.
//!
//! | variable | meaning |
//! | --- | --- |
//! | `FAULT_CRASH_POINT` | the one armed point, the [`CrashPoint::name`] of one of [`CrashPoint::ALL`] |
//! | `FAULT_CRASH_AFTER` | crash on this hit of the point (default 1) |
//! | `FAULT_CRASH_LOG` | file a line `<point name> <unix time in ms>` is appended to just before the crash |

use schema::RecoveryPoint;

/// A crash point, in the order a CreateRide passes them. `<Phase>BeforeCommit` fires once the
/// phase's work is decided, immediately before its one statement is sent (a crash there leaves
/// nothing of the phase in the database); `AfterCommit` fires once the statement (its own implicit
/// transaction) has committed and before the caller learns of it. A fresh key commits two phases
/// in each of its two statements, and both phases' points fire around each:
/// - its claim commits phase `started` with the key (`crate::rides::claim`):
///   `started.before_commit` fires before the claim's statement, and `claim.after_commit` and
///   `started.after_commit` after it;
/// - the charge's record commits phase `charge_created` with it (`crate::rides`'s
///   `ride_created`): `charge_created.before_commit` and `ride_created.before_commit` fire before
///   that statement, and `ride_created.after_commit` and `charge_created.after_commit` after it.
///
/// Typed, so a misspelt point is a compile error rather than a point
/// that never fires; [`CrashPoint::ALL`] is the list the campaign arms, and [`CrashPoint::name`]
/// the one spelling `FAULT_CRASH_POINT` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrashPoint {
    StartedBeforeCommit,
    ClaimAfterCommit,
    StartedAfterCommit,
    ChargeBeforeCall,
    ChargeAfterSuccess,
    ChargeCreatedBeforeCommit,
    RideCreatedBeforeCommit,
    RideCreatedAfterCommit,
    ChargeCreatedAfterCommit,
}

impl CrashPoint {
    /// Every point, in the order a CreateRide passes them.
    pub const ALL: [CrashPoint; 9] = [
        CrashPoint::StartedBeforeCommit,
        CrashPoint::ClaimAfterCommit,
        CrashPoint::StartedAfterCommit,
        CrashPoint::ChargeBeforeCall,
        CrashPoint::ChargeAfterSuccess,
        CrashPoint::ChargeCreatedBeforeCommit,
        CrashPoint::RideCreatedBeforeCommit,
        CrashPoint::RideCreatedAfterCommit,
        CrashPoint::ChargeCreatedAfterCommit,
    ];

    /// The point's name in `FAULT_CRASH_POINT` and in the campaign's report.
    pub const fn name(self) -> &'static str {
        match self {
            CrashPoint::StartedBeforeCommit => "started.before_commit",
            CrashPoint::ClaimAfterCommit => "claim.after_commit",
            CrashPoint::StartedAfterCommit => "started.after_commit",
            CrashPoint::ChargeBeforeCall => "charge.before_call",
            CrashPoint::ChargeAfterSuccess => "charge.after_success",
            CrashPoint::ChargeCreatedBeforeCommit => "charge_created.before_commit",
            CrashPoint::RideCreatedBeforeCommit => "ride_created.before_commit",
            CrashPoint::RideCreatedAfterCommit => "ride_created.after_commit",
            CrashPoint::ChargeCreatedAfterCommit => "charge_created.after_commit",
        }
    }

    /// The point around the commit of the atomic phase that starts at `phase`: before its
    /// statement is sent, or after it committed. Only `ride_created` has an atomic phase of its
    /// own: `started`'s is the claim's statement and `charge_created`'s is `ride_created`'s, which
    /// fire their points themselves, and no phase starts from `finished`.
    pub const fn around_phase(phase: RecoveryPoint, committed: bool) -> Option<CrashPoint> {
        match (phase, committed) {
            (RecoveryPoint::RideCreated, false) => Some(CrashPoint::RideCreatedBeforeCommit),
            (RecoveryPoint::RideCreated, true) => Some(CrashPoint::RideCreatedAfterCommit),
            (
                RecoveryPoint::Started | RecoveryPoint::ChargeCreated | RecoveryPoint::Finished,
                _,
            ) => None,
        }
    }
}

/// Crashes the process here if this point is armed and its countdown has run out.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn crash_point(_point: CrashPoint) {}

/// Crashes the process here if this point is armed and its countdown has run out.
#[cfg(feature = "fault-injection")]
pub fn crash_point(point: CrashPoint) {
    armed::crash_point(point.name());
}

/// Appends `<point> <unix ms>` to the crash log in one write(2), then syncs it. The api-servers
/// of a campaign share the file; `writeln!` writes piece by piece, and O_APPEND keeps each write,
/// not each line, together (CI once saw two points run into one line and the campaign count a
/// crash short of the exits).
#[cfg(any(test, feature = "fault-injection"))]
fn append_crash_line(path: &str, point: &str, unix_ms: u128) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    file.write_all(format!("{point} {unix_ms}\n").as_bytes())?;
    file.sync_all()
}

#[cfg(feature = "fault-injection")]
mod armed {
    use std::sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    };

    struct Armed {
        point: String,
        remaining: AtomicU64,
        log: Option<String>,
    }

    fn armed() -> Option<&'static Armed> {
        static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
        ARMED
            .get_or_init(|| {
                let point = std::env::var("FAULT_CRASH_POINT").ok()?;
                let after = std::env::var("FAULT_CRASH_AFTER")
                    .ok()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(1_u64)
                    .max(1);
                tracing::warn!(point, after, "fault injection: crash point armed");
                Some(Armed {
                    point,
                    remaining: AtomicU64::new(after),
                    log: std::env::var("FAULT_CRASH_LOG").ok(),
                })
            })
            .as_ref()
    }

    pub(super) fn crash_point(point: &str) {
        let Some(armed) = armed() else { return };
        if armed.point != point || armed.remaining.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        if let Some(path) = &armed.log {
            // When, so that a campaign can time what the crash cost the keys it held.
            let unix_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| since.as_millis());
            let _ = super::append_crash_line(path, point, unix_ms);
        }
        // SIGKILL, like the campaign's random kills: no destructor, no flush, no graceful close
        // of connections. abort() is the fallback if `kill` cannot run.
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &std::process::id().to_string()])
            .status();
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Processes crashing at once share the log: every line must come out whole. Threads with
    /// their own file handles race the same way (each open is its own O_APPEND description).
    #[test]
    fn crash_lines_written_at_once_stay_whole() {
        let dir = std::env::temp_dir().join(format!("crash-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("crashes.log").display().to_string();
        let (writers, lines_each) = (8, 200);
        std::thread::scope(|scope| {
            for writer in 0..writers {
                let path = &path;
                scope.spawn(move || {
                    for n in 0..lines_each {
                        let point = CrashPoint::ALL[writer % CrashPoint::ALL.len()].name();
                        append_crash_line(path, point, n).unwrap();
                    }
                });
            }
        });
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let names: Vec<_> = CrashPoint::ALL.iter().map(|point| point.name()).collect();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines.len(), writers * lines_each as usize);
        for line in lines {
            let (point, ms) = line.split_once(' ').unwrap();
            assert!(names.contains(&point), "{line:?}");
            assert!(ms.parse::<u128>().is_ok(), "{line:?}");
        }
    }

    #[test]
    fn every_point_has_its_own_name_and_is_listed_once() {
        let names: std::collections::HashSet<_> =
            CrashPoint::ALL.iter().map(|point| point.name()).collect();
        assert_eq!(names.len(), CrashPoint::ALL.len());
    }

    /// Every recovery point a key passes has a point on each side of the commit that reaches
    /// or leaves it, and the name says which point and which side (what an operator reads in the
    /// campaign's report); only `ride_created`'s are fired by the atomic phase itself.
    #[test]
    fn each_recovery_point_has_a_point_before_and_after_its_commit() {
        for phase in [
            RecoveryPoint::Started,
            RecoveryPoint::RideCreated,
            RecoveryPoint::ChargeCreated,
        ] {
            for (committed, side) in [(false, "before_commit"), (true, "after_commit")] {
                let name = format!("{}.{side}", phase.as_str());
                assert!(
                    CrashPoint::ALL.iter().any(|point| point.name() == name),
                    "{name}"
                );
                let fired_by_the_phase = CrashPoint::around_phase(phase, committed);
                assert_eq!(
                    fired_by_the_phase.map(CrashPoint::name),
                    (phase == RecoveryPoint::RideCreated).then_some(name.as_str())
                );
            }
        }
        assert_eq!(
            CrashPoint::around_phase(RecoveryPoint::Finished, false),
            None
        );
    }
}
