//! The campaign's figures per window, the verdict per attack against its goals, and the
//! table printed at the end (the one docs/security.md publishes).

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use bench::latency::Percentiles;
use serde::Serialize;
use serde_json::Value;

use crate::{
    attacks::Attack,
    backend::BackendRun,
    observe::{Database, Sampler, Usage},
    traffic::Phases,
};

/// The api-server's peak RSS must stay under this in every attack.
const RSS_GOAL_MIB: f64 = 150.0;
/// The legitimate clients' p99 must stay within this multiple of the quiet baseline's.
const P99_GOAL_RATIO: f64 = 3.0;

/// What one phase looked like from both sides.
#[derive(Debug, Serialize)]
pub struct Window {
    pub secs: f64,
    pub usage: Usage,
    pub create: Percentiles,
    pub get: Percentiles,
    pub errors: BTreeMap<String, u64>,
    pub db: Database,
}

impl Window {
    pub fn new(
        phases: &Phases,
        sampler: &Sampler,
        index: usize,
        from: Instant,
        db: Database,
    ) -> Window {
        let to = Instant::now();
        let (create, get, errors) = phases
            .with(index, |s| {
                (
                    s.create.percentiles(),
                    s.get.percentiles(),
                    s.errors.clone(),
                )
            })
            .unwrap_or_default();
        Window {
            secs: to.duration_since(from).as_secs_f64(),
            usage: sampler.window(from, to),
            create,
            get,
            errors,
            db,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct AttackResult {
    pub attack: &'static str,
    pub authenticated: bool,
    pub during: Window,
    /// Rows of non-legitimate users written from the attack's start until after the recovery.
    pub written: Database,
    pub connections_refused: BTreeMap<String, f64>,
    pub recovery_ms: Option<u64>,
    pub attacker: Value,
    /// The legitimate backend's run during the attack.
    pub backend: Option<BackendRun>,
}

pub fn difference(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(labels, n)| {
            (
                labels.clone(),
                n - before.get(labels).copied().unwrap_or(0.0),
            )
        })
        .filter(|(_, n)| *n > 0.0)
        .collect()
}

impl AttackResult {
    pub fn new(
        attack: Attack,
        during: Window,
        written: Database,
        connections_refused: BTreeMap<String, f64>,
        recovery: Option<Duration>,
        attacker: Value,
        backend: Option<BackendRun>,
    ) -> AttackResult {
        AttackResult {
            attack: attack.name(),
            authenticated: attack.authenticated(),
            during,
            written,
            connections_refused,
            recovery_ms: recovery.map(|d| d.as_millis() as u64),
            attacker,
            backend,
        }
    }

    fn rows_written(&self) -> i64 {
        self.written.attacker_keys
            + self.written.attacker_rides
            + self.written.attacker_audit_records
    }

    /// The goals this attack missed (none: it passed).
    pub fn misses(&self, baseline: &Window, recovery_goal: Duration) -> Vec<String> {
        let mut misses = Vec::new();
        let w = &self.during;
        if w.usage.peak_rss_mib >= RSS_GOAL_MIB {
            misses.push(format!("peak RSS {:.0} MiB", w.usage.peak_rss_mib));
        }
        for (what, now, quiet) in [
            ("create", &w.create, &baseline.create),
            ("get", &w.get, &baseline.get),
        ] {
            if now.count == 0 {
                misses.push(format!("no legitimate {what} succeeded"));
            } else if now.p99_ms > P99_GOAL_RATIO * quiet.p99_ms {
                misses.push(format!(
                    "{what} p99 {:.1} ms > {P99_GOAL_RATIO}× {:.1} ms",
                    now.p99_ms, quiet.p99_ms
                ));
            }
        }
        let errors: u64 = w.errors.values().sum();
        if errors > 0 {
            misses.push(format!("{errors} legitimate calls failed"));
        }
        if !self.authenticated && self.rows_written() != 0 {
            misses.push(format!(
                "{} rows written by an unauthenticated attacker",
                self.rows_written()
            ));
        }
        match self.recovery_ms {
            Some(ms) if ms <= recovery_goal.as_millis() as u64 => {}
            Some(ms) => misses.push(format!("served again only after {ms} ms")),
            None => misses.push("not serving new connections 30 s after".to_owned()),
        }
        misses
    }

    pub fn line(&self, baseline: &Window) -> String {
        let w = &self.during;
        let ratio = |now: f64, quiet: f64| if quiet > 0.0 { now / quiet } else { f64::NAN };
        format!(
            "| {} | {:.0} | {:.1} | {:.2} / {:.2} | {:.2} | {:.0} % | {:.1} / {:.1} ({:.1}×) | {:.1} / {:.1} ({:.1}×) | {} | {} | {} | {} |",
            self.attack,
            w.secs,
            w.usage.peak_rss_mib,
            w.usage.cpu_mean_cores,
            w.usage.cpu_peak_cores,
            w.usage.campaign_cores,
            100.0 * w.usage.machine_busy,
            w.create.p50_ms,
            w.create.p99_ms,
            ratio(w.create.p99_ms, baseline.create.p99_ms),
            w.get.p50_ms,
            w.get.p99_ms,
            ratio(w.get.p99_ms, baseline.get.p99_ms),
            w.errors.values().sum::<u64>(),
            self.connections_refused.values().sum::<f64>() as u64,
            self.rows_written(),
            self.recovery_ms
                .map_or_else(|| "never".to_owned(), |ms| format!("{ms} ms")),
        )
    }
}

pub const HEADER: &str = "| attack | s | api-server peak RSS MiB | api-server CPU cores mean / peak | campaign CPU cores | machine busy | legit create p50 / p99 ms (× quiet p99) | legit get p50 / p99 ms (× quiet p99) | legit errors | conns refused | attacker rows | served again after |\n|---|---|---|---|---|---|---|---|---|---|---|---|";

/// Prints the table, each attack's own figures and the verdicts; whether every goal was met.
pub fn print(baseline: &Window, results: &[AttackResult], recovery_goal: Duration) -> bool {
    println!("\n{HEADER}");
    println!(
        "| quiet | {:.0} | {:.1} | {:.2} / {:.2} | {:.2} | {:.0} % | {:.1} / {:.1} | {:.1} / {:.1} | {} | - | - | - |",
        baseline.secs,
        baseline.usage.peak_rss_mib,
        baseline.usage.cpu_mean_cores,
        baseline.usage.cpu_peak_cores,
        baseline.usage.campaign_cores,
        100.0 * baseline.usage.machine_busy,
        baseline.create.p50_ms,
        baseline.create.p99_ms,
        baseline.get.p50_ms,
        baseline.get.p99_ms,
        baseline.errors.values().sum::<u64>(),
    );
    for result in results {
        println!("{}", result.line(baseline));
    }
    let mut all_met = true;
    println!();
    for result in results {
        println!("{}: {}", result.attack, result.attacker);
        if !result.during.errors.is_empty() {
            println!("  legitimate errors: {:?}", result.during.errors);
        }
        if !result.connections_refused.is_empty() {
            println!("  connections refused: {:?}", result.connections_refused);
        }
        let misses = result.misses(baseline, recovery_goal);
        if misses.is_empty() {
            println!("  PASS");
        } else {
            all_met = false;
            println!("  MISSED: {}", misses.join("; "));
        }
    }
    println!(
        "\nabuse: {}",
        if all_met {
            "every goal met"
        } else {
            "goals missed (see above)"
        }
    );
    all_met
}

/// The backend's table and its verdicts: every call OK without a retry, and against
/// the mean of `references` (the runs with every defence lifted) throughput and p99 within the
/// goals. Whether every goal was met.
pub fn print_backend(
    alone: Option<&BackendRun>,
    results: &[AttackResult],
    references: &[BackendRun],
) -> bool {
    let Some(alone) = alone else {
        return true;
    };
    // Judged against the mean of the reference runs (every defence lifted).
    let reference = BackendRun::mean(references);
    let reference = reference.as_ref();
    println!(
        "\n| backend run | OK / calls | OK/s (× lifted) | p50 / p99 ms (× lifted) | not OK |\n|---|---|---|---|---|"
    );
    for (n, run) in references.iter().enumerate() {
        println!("| every defence lifted #{} | {} |", n + 1, run.cells(None));
    }
    let runs = std::iter::once(("alone", alone)).chain(
        results
            .iter()
            .filter_map(|result| Some((result.attack, result.backend.as_ref()?))),
    );
    let runs: Vec<_> = runs.collect();
    for (name, run) in &runs {
        println!("| {name} | {} |", run.cells(reference));
    }
    let mut all_met = true;
    println!();
    for (name, run) in &runs {
        let misses = match reference {
            Some(reference) => run.misses(reference),
            None => run.misses(&BackendRun::default()),
        };
        if misses.is_empty() {
            println!("backend {name}: PASS");
        } else {
            all_met = false;
            println!("backend {name}: MISSED: {}", misses.join("; "));
        }
    }
    all_met
}
