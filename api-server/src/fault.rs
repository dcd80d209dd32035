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
//! | `FAULT_CRASH_POINT` | the one armed point, one of [`CRASH_POINTS`] |
//! | `FAULT_CRASH_AFTER` | crash on this hit of the point (default 1) |
//! | `FAULT_CRASH_LOG` | file the point's name is appended to just before the crash |

/// Every crash point, in the order a CreateRide passes them. `<phase>.before_commit` fires once the
/// phase's work is decided, immediately before its one statement is sent (a crash there leaves
/// nothing of the phase in the database); `.after_commit` fires once the statement (its own
/// implicit transaction) has committed and before the caller learns of it. A fresh key commits
/// two phases in each of its two statements, and both phases' points fire around each:
/// - its claim commits phase `started` with the key (`crate::idempotency::FirstRide`):
///   `started.before_commit` fires before the claim's statement, and `claim.after_commit` and
///   `started.after_commit` after it;
/// - the charge's record commits phase `charge_created` with it (`crate::rides`'s
///   `record_charge`): `charge_created.before_commit` and `ride_created.before_commit` fire before
///   that statement, and `ride_created.after_commit` and `charge_created.after_commit` after it.
///
/// A key left at `started` or `charge_created` (an older server's) passes that phase's own points
/// around its own statement.
pub const CRASH_POINTS: &[&str] = &[
    "started.before_commit",
    "claim.after_commit",
    "started.after_commit",
    "charge.before_call",
    "charge.after_success",
    "charge_created.before_commit",
    "ride_created.before_commit",
    "ride_created.after_commit",
    "charge_created.after_commit",
];

/// Crashes the process here if this point is armed and its countdown has run out.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn crash_point(_point: &str) {}

/// Crashes the process here if this point is armed and its countdown has run out.
#[cfg(feature = "fault-injection")]
pub fn crash_point(point: &str) {
    armed::crash_point(point);
}

#[cfg(feature = "fault-injection")]
mod armed {
    use std::{
        io::Write,
        sync::{
            OnceLock,
            atomic::{AtomicU64, Ordering},
        },
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
        if let Some(path) = &armed.log
            && let Ok(mut file) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
        {
            let _ = writeln!(file, "{point}");
            let _ = file.sync_all();
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

    #[test]
    fn crash_points_are_unique_and_name_every_phase() {
        let mut seen = std::collections::HashSet::new();
        assert!(CRASH_POINTS.iter().all(|p| seen.insert(*p)));
        for phase in ["started", "ride_created", "charge_created"] {
            assert!(CRASH_POINTS.contains(&format!("{phase}.before_commit").as_str()));
            assert!(CRASH_POINTS.contains(&format!("{phase}.after_commit").as_str()));
        }
    }
}
