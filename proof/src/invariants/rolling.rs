//! The invariants of `--rolling`: what callers see while every api-server and worker
//! is replaced, one at a time, during traffic. Checked only in that mode; every other invariant
//! holds there too.

use std::{collections::BTreeMap, path::Path};

use crate::{
    args::Args,
    clients::{KeyRecord, Seen},
};

use super::Violations;

/// The ids of this file's invariants (`super::INVARIANTS` describes them).
pub(crate) const INVARIANTS: [&str; 4] = [
    "rolling_every_call_answered",
    "rolling_no_internal",
    "rolling_replaced",
    "rolling_drained",
];

/// The processes a rollout replaces, by the name their counts and logs carry.
const REPLACED: [&str; 4] = ["api-server", "api-server-b", "enqueuer", "receipts"];

/// What an api-server logs when SIGTERM starts its shutdown, and when it starts draining: each
/// must appear once per rollout in each api-server's log.
const SHUTDOWN_LINES: [&str; 2] = [
    api_server::server::LOG_SHUTTING_DOWN,
    api_server::server::LOG_DRAINING,
];

/// Checks the rolling invariants (none without `--rolling`): every call answered with a final
/// outcome, no attempt answered `INTERNAL`, every process replaced `--rollouts` times after a
/// drain within its grace, and each api-server's log showing its shutdown and drain each time.
pub(crate) fn check(
    args: &Args,
    records: &[KeyRecord],
    attempts: &BTreeMap<String, u64>,
    faults: &BTreeMap<String, u64>,
    log_dir: &Path,
    v: &mut Violations,
) {
    if !args.rolling {
        return;
    }
    for record in records {
        if let Seen::GaveUp(_) | Seen::Abandoned(_) | Seen::Unexpected(_) = &record.seen {
            v.add(
                "rolling_every_call_answered",
                format!(
                    "key {} ({} attempts) ended {}: {}",
                    record.key,
                    record.attempts,
                    record.seen.kind(),
                    record.seen.detail()
                ),
            );
        }
    }
    // Labels are `Code/REASON` (`rides_client`). The api-server answers INTERNAL always with the
    // reason INTERNAL (`grpc::status`); `Internal/-` is no answer of the server but an HTTP/2
    // stream reset as tonic reports it client-side, retried like `Unavailable/-` and counted in
    // the report's table of answers, not here.
    for (outcome, count) in attempts {
        if outcome.ends_with("/INTERNAL") {
            v.add(
                "rolling_no_internal",
                format!("{count} attempts answered {outcome}"),
            );
        }
    }
    for name in REPLACED {
        let count = |label: &str| faults.get(&format!("{label}/{name}")).copied();
        let replaced = count("rollout").unwrap_or(0);
        if replaced != u64::from(args.rollouts) {
            v.add(
                "rolling_replaced",
                format!(
                    "{name} was replaced {replaced} times, not {}",
                    args.rollouts
                ),
            );
        }
        if let Some(killed) = count("rollout_killed") {
            v.add(
                "rolling_replaced",
                format!("{name} did not exit within its grace after SIGTERM {killed} times"),
            );
        }
    }
    for name in &REPLACED[..2] {
        let log = std::fs::read_to_string(log_dir.join(format!("{name}.log"))).unwrap_or_default();
        for line in SHUTDOWN_LINES {
            let seen = log.matches(line).count();
            if seen < args.rollouts as usize {
                v.add(
                    "rolling_drained",
                    format!(
                        "{name}.log has {seen} lines {line:?}, not {}",
                        args.rollouts
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn record(key: &str, seen: Seen) -> KeyRecord {
        KeyRecord {
            key: key.to_owned(),
            user_id: 1,
            client: 0,
            params: Default::default(),
            attempts: 3,
            seen,
        }
    }

    fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    /// A log directory whose api-server logs show `shutdowns` shutdowns and drains each.
    fn logs(name: &str, shutdowns: usize) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("proof-rolling-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for log in ["api-server", "api-server-b"] {
            std::fs::write(
                dir.join(format!("{log}.log")),
                SHUTDOWN_LINES.join("\n").repeat(shutdowns),
            )
            .unwrap();
        }
        dir
    }

    fn replaced(times: u64) -> BTreeMap<String, u64> {
        REPLACED
            .iter()
            .map(|name| (format!("rollout/{name}"), times))
            .collect()
    }

    #[test]
    fn a_clean_rollout_passes_and_each_failure_names_its_invariant() {
        let args = Args::parse_from(["proof", "--rolling", "--rollouts", "2"]);
        let answered = [record(
            "k0",
            Seen::Declined {
                message: "Your card was declined.".into(),
                details: Vec::new(),
            },
        )];
        let mut clean = Violations::default();
        check(
            &args,
            &answered,
            &counts(&[("OK", 10), ("Unavailable/-", 4)]),
            &replaced(2),
            &logs("clean", 2),
            &mut clean,
        );
        assert!(clean.list.is_empty(), "{:?}", clean.list);

        let mut v = Violations::default();
        let mut faults = replaced(2);
        faults.insert("rollout/enqueuer".into(), 1);
        faults.insert("rollout_killed/receipts".into(), 1);
        check(
            &args,
            &[
                record("k1", Seen::GaveUp("Unavailable/-".into())),
                record("k2", Seen::Abandoned("dropped".into())),
                answered[0].clone(),
            ],
            &counts(&[("OK", 10), ("Internal/INTERNAL", 2), ("Internal/-", 3)]),
            &faults,
            &logs("failing", 1),
            &mut v,
        );
        assert_eq!(v.by_invariant["rolling_every_call_answered"], 2);
        assert_eq!(v.by_invariant["rolling_no_internal"], 1);
        assert_eq!(v.by_invariant["rolling_replaced"], 2);
        assert_eq!(v.by_invariant["rolling_drained"], 4);
    }

    #[test]
    fn nothing_is_checked_without_rolling() {
        let args = Args::parse_from(["proof"]);
        let mut v = Violations::default();
        check(
            &args,
            &[record("k1", Seen::GaveUp("x".into()))],
            &counts(&[("Internal/INTERNAL", 1)]),
            &BTreeMap::new(),
            Path::new("/nonexistent"),
            &mut v,
        );
        assert!(v.list.is_empty());
    }
}
