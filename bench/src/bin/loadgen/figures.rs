//! The run's figures: computed once from the clients' counts and what the samplers saw, printed
//! for a person and appended as one JSON line (`--json-out`) for `bench-report`.

use std::{collections::BTreeMap, path::Path, time::Duration};

use anyhow::Context;
use bench::{latency::Percentiles, server_counters};
use serde_json::{Value, json};

use crate::{args::Args, clients::ClientStats, samplers::Sampled};

/// The figures of the measured window.
pub(crate) struct Figures {
    secs: f64,
    throughput: f64,
    p: Percentiles,
    cpu: BTreeMap<String, f64>,
    cpu_ms_per_request: BTreeMap<String, f64>,
    machine_busy: Option<f64>,
    commits_per_request: Option<f64>,
    batch_fill: BTreeMap<String, f64>,
    claim_statements_per_request: Option<f64>,
    wait_polls_per_request: Option<f64>,
    waits_avg: BTreeMap<String, f64>,
}

/// The run's shape, for the summary.
pub(crate) struct Shape<'a> {
    pub(crate) users: usize,
    pub(crate) connections: usize,
    pub(crate) started_at_load: &'a str,
}

impl Figures {
    pub(crate) fn new(total: &ClientStats, sampled: &Sampled, elapsed: Duration) -> Figures {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let ticks_per_s = bench::procfs::TICKS_PER_SEC as f64;
        let cpu: BTreeMap<String, f64> = sampled
            .cpu_groups
            .iter()
            .zip(sampled.cpu_before.iter().zip(&sampled.cpu_after))
            .map(|((name, _), (before, after))| {
                (
                    name.clone(),
                    after.saturating_sub(*before) as f64 / ticks_per_s / secs,
                )
            })
            .collect();
        let machine_busy = match (sampled.machine_before, sampled.machine_after) {
            (Some((busy0, all0)), Some((busy1, all1))) if all1 > all0 => {
                Some((busy1 - busy0) as f64 / (all1 - all0) as f64)
            }
            _ => None,
        };
        // Per request of the window: CPU in each process group, and the database's commits.
        let done = total.measured_done;
        let per_request = |value: f64| (done > 0).then(|| value * secs / done as f64);
        let cpu_ms_per_request = cpu
            .iter()
            .filter_map(|(name, cores)| Some((name.clone(), per_request(cores * 1000.0)?)))
            .collect();
        let (before, after) = (&sampled.counters_before, &sampled.counters_after);
        let commits_per_request = match (before.commits, after.commits) {
            (Some(before), Some(after)) => per_request((after - before) as f64 / secs),
            _ => None,
        };
        let per_logical_request = |before: Option<f64>, after: Option<f64>| {
            let (before, after) = (before?, after?);
            (done > 0).then(|| (after - before) / done as f64)
        };
        let (samples, waits) = &sampled.wait_samples;
        Figures {
            secs,
            throughput: total.measured_ok as f64 / secs,
            p: total.latencies.percentiles(),
            cpu,
            cpu_ms_per_request,
            machine_busy,
            commits_per_request,
            batch_fill: server_counters::batch_fill(&before.batches, &after.batches),
            claim_statements_per_request: per_logical_request(
                before.claim_statements,
                after.claim_statements,
            ),
            wait_polls_per_request: per_logical_request(before.wait_polls, after.wait_polls),
            waits_avg: waits
                .iter()
                .map(|(k, v)| (k.clone(), *v as f64 / (*samples).max(1) as f64))
                .collect(),
        }
    }

    /// The run's shape, throughput, latency and every answer.
    pub(crate) fn print(
        &self,
        args: &Args,
        users: usize,
        connections: usize,
        total: &ClientStats,
        sampled: &Sampled,
    ) {
        let p = &self.p;
        println!(
            "scenario {}  clients {}  users {users}  connections {connections}",
            args.scenario, args.clients,
        );
        println!(
            "measured {:.2} s: {} requests, {} succeeded -> {:.1} CreateRide/s",
            self.secs, total.measured_done, total.measured_ok, self.throughput
        );
        println!(
            "latency ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2}  mean {:.2}",
            p.p50_ms, p.p90_ms, p.p99_ms, p.max_ms, p.mean_ms
        );
        let not_ok: BTreeMap<&String, &u64> = total
            .attempts
            .iter()
            .filter(|(label, _)| !label.starts_with("OK"))
            .collect();
        println!(
            "non-OK answers (every attempt, warm-up included): {} {:?}",
            not_ok.values().copied().sum::<u64>(),
            not_ok
        );
        println!("attempt outcomes (code/reason):");
        for (outcome, count) in &total.attempts {
            println!("  {outcome:<55} {count}");
        }
        println!(
            "keys: new ok {}  new failed {}  replays ok {}  replays not marked replayed {}  replays failed {}",
            total.new_keys_ok,
            total.new_keys_failed,
            total.replays_ok,
            total.replays_not_marked,
            total.replays_failed
        );
        self.print_costs(sampled);
    }

    /// Where the time went: CPU by process group, commits, statements, batch fill, wait events,
    /// memory.
    fn print_costs(&self, sampled: &Sampled) {
        println!("CPU (cores busy on average over the run; 2 cores total):");
        for (name, cores) in &self.cpu {
            let per = self
                .cpu_ms_per_request
                .get(name)
                .map_or_else(String::new, |ms| format!("  ({ms:.3} ms per request)"));
            println!("  {name:<32} {cores:.2}{per}");
        }
        if let Some(busy) = self.machine_busy {
            println!("  machine total busy fraction     {busy:.2}");
        }
        if let Some(commits) = self.commits_per_request {
            println!(
                "database commits per request (pg_stat_database, this database): {commits:.2}"
            );
        }
        if let (Some(claims), Some(polls)) = (
            self.claim_statements_per_request,
            self.wait_polls_per_request,
        ) {
            println!(
                "claim statements per logical request: {claims:.2}  (waiters' key reads: {polls:.2})"
            );
        }
        if !self.batch_fill.is_empty() {
            println!("batch fill (requests per batched statement, mean over the window):");
            for (statement, fill) in &self.batch_fill {
                println!("  {statement:<32} {fill:.2}");
            }
        }
        let samples = sampled.wait_samples.0;
        println!(
            "pg_stat_activity of this database, non-idle backends per sample ({samples} samples):"
        );
        let mut sorted: Vec<_> = self.waits_avg.iter().collect();
        sorted.sort_by(|a, b| b.1.total_cmp(a.1));
        for (what, avg) in sorted.iter().take(12) {
            println!("  {what:<55} {avg:.2}");
        }
        if let Some((peak, last)) = sampled.rss {
            println!(
                "api-server VmRSS: peak {:.1} MB, end {:.1} MB",
                peak as f64 / 1024.0,
                last as f64 / 1024.0
            );
        }
    }

    /// The run as one JSON object (`bench-report` reads these).
    pub(crate) fn summary(
        &self,
        args: &Args,
        shape: &Shape<'_>,
        total: &ClientStats,
        sampled: &Sampled,
        check: Option<(bool, Value)>,
    ) -> Value {
        let p = &self.p;
        let (check_pass, check) = match check {
            Some((pass, detail)) => (Some(pass), Some(detail)),
            None => (None, None),
        };
        json!({
            "kind": "loadgen",
            "scenario": args.scenario,
            "clients": args.clients,
            "users": shape.users,
            "riders": args.riders,
            "max_attempts": args.max_attempts,
            "connections": shape.connections,
            "replay_ratio": args.replay_ratio,
            "provider_latency_ms": args.provider_latency_ms,
            "seconds": self.secs,
            "requests": total.measured_done,
            "successes": total.measured_ok,
            "throughput": self.throughput,
            "p50_ms": p.p50_ms, "p90_ms": p.p90_ms, "p99_ms": p.p99_ms, "max_ms": p.max_ms, "mean_ms": p.mean_ms,
            "attempts": total.attempts,
            "conflicts_surfaced": total.aborted,
            "failed": total.new_keys_failed + total.replays_failed,
            "new_keys_ok": total.new_keys_ok,
            "replays_ok": total.replays_ok,
            "replays_not_marked": total.replays_not_marked,
            "check_pass": check_pass,
            "check": check,
            "cpu_cores": self.cpu,
            "cpu_ms_per_request": self.cpu_ms_per_request,
            "commits_per_request": self.commits_per_request,
            "batch_fill": self.batch_fill,
            "claim_statements_per_request": self.claim_statements_per_request,
            "wait_polls_per_request": self.wait_polls_per_request,
            "attempt_timeout_ms": args.attempt_timeout_ms,
            "idempotency_wait_ms": args.idempotency_wait_ms,
            "machine_busy": self.machine_busy,
            "pg_waits_avg_backends": self.waits_avg,
            "server_rss_peak_kb": sampled.rss.map(|r| r.0),
            "server_rss_end_kb": sampled.rss.map(|r| r.1),
            "load_avg": format!("{} -> {}", shape.started_at_load, sampled.ended_at_load),
        })
    }
}

/// Appends `summary` as one line to `path`.
pub(crate) fn append_json(path: &Path, summary: &Value) -> anyhow::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    writeln!(file, "{summary}")?;
    Ok(())
}
