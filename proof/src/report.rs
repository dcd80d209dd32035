//! What the campaign tells: a progress line every 10 s while traffic runs, and at the end the
//! report, as text on stdout and in `report.txt`, as JSON in `report.json` (for scripts and
//! comparisons between runs), with every violation in `violations.txt` and every key's final
//! answer in `keys.jsonl`, all in the run's out directory. The `--ha` part (each fault's outage
//! and their spread per class) is [`ha`]'s.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::{
    args::Args,
    clients::KeyRecord,
    counters::{Counters, Tallies},
    faults::sleep_unless_stopped,
    holder_deaths::{CauseCost, HolderDeaths, KILL_GOAL},
    invariants::{Facts, INVARIANTS, Verdict},
    maintenance::Drain,
    outages,
    setup::{Plan, Wiring},
};

mod ha;
use ha::{ha_faults, ha_outage_spread, text_ha_faults};

/// Progress: requests and fault events so far, every 10 s until `stop`.
pub(crate) fn progress(
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicU64>,
    faults: Arc<Counters>,
    traffic_start: Instant,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while sleep_unless_stopped(&stop, Duration::from_secs(10)).await {
            let f: u64 = faults.snapshot().values().sum();
            println!(
                "proof: t+{:>4}s requests {:>6}, fault events {f}",
                traffic_start.elapsed().as_secs(),
                AtomicU64::load(&requests, Ordering::Relaxed)
            );
        }
    })
}

/// Every key, one JSON line each.
pub(crate) fn write_keys(out_dir: &Path, records: &[KeyRecord]) -> anyhow::Result<()> {
    let keys_jsonl: String = records
        .iter()
        .map(|r| {
            json!({"key": r.key, "user_id": r.user_id, "client": r.client, "attempts": r.attempts,
                   "seen": r.seen.kind(), "detail": r.seen.detail()})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(out_dir.join("keys.jsonl"), keys_jsonl)?;
    Ok(())
}

/// Everything the report tells, from the steps before it.
pub(crate) struct Report<'a> {
    pub(crate) args: &'a Args,
    pub(crate) plan: &'a Plan,
    pub(crate) wiring: &'a Wiring,
    pub(crate) tallies: &'a Tallies,
    pub(crate) drain: &'a Drain,
    pub(crate) facts: &'a Facts<'a>,
    pub(crate) verdict: &'a Verdict,
    /// The money campaign's figures (`None` without `--money`).
    pub(crate) money: Option<Value>,
    pub(crate) holder_deaths: &'a HolderDeaths,
}

impl Report<'_> {
    /// Prints and writes the report; whether every invariant held.
    pub(crate) fn write(&self) -> anyhow::Result<bool> {
        let total = self.plan.started.elapsed();
        let v = &self.verdict.violations;
        let passed = v.list.is_empty();
        let report = self.json(total, passed);
        let text = self.text(&report, total, passed);
        println!("\n{text}");
        let out_dir = &self.plan.out_dir;
        std::fs::write(
            out_dir.join("report.json"),
            serde_json::to_string_pretty(&report)?,
        )?;
        std::fs::write(out_dir.join("report.txt"), &text)?;
        if !v.list.is_empty() {
            std::fs::write(out_dir.join("violations.txt"), v.list.join("\n"))?;
        }
        println!("proof: report in {}", out_dir.display());
        Ok(passed)
    }

    fn json(&self, total: Duration, passed: bool) -> Value {
        let (args, plan, tallies, drain) = (self.args, self.plan, self.tallies, self.drain);
        let (ev, verdict) = (self.facts.evidence, self.verdict);
        let v = &verdict.violations;
        let mut invariant_json = serde_json::Map::new();
        for (id, _) in &INVARIANTS {
            invariant_json.insert(
                (*id).to_owned(),
                json!(v.by_invariant.get(id).copied().unwrap_or(0)),
            );
        }
        let attention_by_reason =
            ev.attention
                .iter()
                .fold(BTreeMap::<String, u64>::new(), |mut m, a| {
                    *m.entry(a.reason.clone()).or_default() += 1;
                    m
                });
        let fault_rows = outages::per_fault(&tallies.timeline);
        json!({
            "run_id": plan.run_id,
            "seed": plan.seed,
            "mode": if args.long { "long" } else { "short" },
            "topology": if args.ha { "ha (Patroni + 3-node RabbitMQ)" } else { "single nodes" },
            "database": self.wiring.db_name,
            "traffic_secs": plan.duration.as_secs(),
            "total_secs": (total.as_secs_f64() * 10.0).round() / 10.0,
            "clients": args.clients,
            "declining_clients": args.declined_clients,
            "keys": self.facts.records.len(),
            "requests": AtomicU64::load(&tallies.requests, Ordering::Relaxed),
            "retries": AtomicU64::load(&tallies.retries, Ordering::Relaxed),
            "outcomes_seen_by_clients": verdict.outcomes,
            "attempt_answers": tallies.attempts.snapshot(),
            "abandoned_keys": verdict.abandoned,
            "faults_injected": tallies.faults.snapshot(),
            "maintenance": tallies.maintenance.snapshot(),
            "drain": {
                "completer_secs": (drain.completer.as_secs_f64() * 10.0).round() / 10.0,
                "receipts_secs": (drain.receipts.as_secs_f64() * 10.0).round() / 10.0,
                "unfinished_keys_left": drain.unfinished,
                "staged_jobs_left": drain.staged,
            },
            "evidence": {
                "rides": ev.rides.len(),
                "charged_rides": ev.rides.iter().filter(|r| r.stripe_charge_id.is_some()).count(),
                "payment_intents": ev.ledger.len(),
                "succeeded_payment_intents": ev.ledger.iter().filter(|p| p.status == "succeeded").count(),
                "sent_receipts": ev.sent_receipts.len(),
                "mails": ev.mail.values().map(Vec::len).sum::<usize>(),
                "receipts_recorded_from_the_relay_search": ev.recovered_at_relay,
                "receipt_claims_left": ev.claims_left,
                "crash_points_fired": verdict.crash_points_fired,
                "keys_needing_attention": attention_by_reason,
            },
            "reconciliation": reconciliation_json(&ev.reconciliation),
            "replays": self.facts.replays.stats,
            "money": self.money,
            "ha_faults": ha_faults(&fault_rows),
            "ha_outage_spread": ha_outage_spread(&fault_rows),
            "holder_deaths": {
                "by_cause": self.holder_deaths.by_cause.iter().map(CauseCost::json).collect::<Vec<_>>(),
                "kills": self.holder_deaths.kills.json(),
                "kill_goal_p99_secs": KILL_GOAL.as_secs_f64(),
                "kill_goal_met": self.holder_deaths.kill_goal().met(),
            },
            "replays_during_traffic": tallies.live_replays.outcomes.snapshot(),
            "invariant_violations": invariant_json,
            "violations": v.list.iter().take(200).collect::<Vec<_>>(),
            "passed": passed,
        })
    }

    fn text(&self, report: &Value, total: Duration, passed: bool) -> String {
        let mut text = String::new();
        self.text_header(&mut text, total);
        self.text_tallies(&mut text);
        if self.args.ha {
            text_ha_faults(&mut text, report);
        }
        self.text_holder_deaths(&mut text);
        section(
            &mut text,
            "completer / reaper passes",
            self.tallies.maintenance.snapshot(),
        );
        self.text_evidence(&mut text, report);
        self.text_invariants(&mut text);
        text.push_str(&format!(
            "RESULT: {}\n",
            if passed { "PASS" } else { "FAIL" }
        ));
        text
    }

    /// The run, its length and its traffic.
    fn text_header(&self, text: &mut String, total: Duration) {
        let (args, plan, tallies) = (self.args, self.plan, self.tallies);
        text.push_str(&format!(
            "Rocket Rides proof campaign {} (seed {}, {} mode)\n",
            plan.run_id,
            plan.seed,
            if args.long { "long" } else { "short" }
        ));
        line(
            text,
            "traffic / total duration",
            format!("{}s / {:.1}s", plan.duration.as_secs(), total.as_secs_f64()),
        );
        line(
            text,
            "clients (declining cards)",
            format!("{} ({})", args.clients, args.declined_clients),
        );
        line(text, "keys", self.facts.records.len().to_string());
        line(
            text,
            "requests (attempts)",
            AtomicU64::load(&tallies.requests, Ordering::Relaxed).to_string(),
        );
        line(
            text,
            "retries",
            AtomicU64::load(&tallies.retries, Ordering::Relaxed).to_string(),
        );
    }

    /// What the clients saw, and the faults injected.
    fn text_tallies(&self, text: &mut String) {
        section(
            text,
            "outcomes seen by clients",
            self.verdict.outcomes.clone(),
        );
        section(
            text,
            "abandoned / given-up keys",
            self.verdict.abandoned.clone(),
        );
        section(
            text,
            "answers per attempt",
            self.tallies.attempts.snapshot(),
        );
        section(
            text,
            "replays during traffic",
            self.tallies.live_replays.outcomes.snapshot(),
        );
        section(text, "faults injected", self.tallies.faults.snapshot());
    }

    /// From each api-server's death to the next final answer of the keys it held.
    fn text_holder_deaths(&self, text: &mut String) {
        let deaths = self.holder_deaths;
        text.push_str("-- holder deaths: from the death to each hurt key's next final answer\n");
        for cost in &deaths.by_cause {
            text.push_str(&format!("  {}\n", cost.line()));
        }
        text.push_str(&format!("  {}\n", deaths.kills.line()));
        text.push_str(&format!(
            "  goal: a killed holder's keys answered within {} s at p99: {}\n",
            KILL_GOAL.as_secs(),
            deaths.kill_goal().text()
        ));
    }

    /// The evidence, the drain, the replays, the reconciler and the money campaign.
    fn text_evidence(&self, text: &mut String, report: &Value) {
        text.push_str("-- evidence\n");
        for (k, val) in report["evidence"].as_object().into_iter().flatten() {
            line(text, &format!("  {k}"), val.to_string());
        }
        for (k, val) in report["drain"].as_object().into_iter().flatten() {
            line(text, &format!("  drain.{k}"), val.to_string());
        }
        for (k, val) in &self.facts.replays.stats {
            line(text, &format!("  replays.{k}"), val.to_string());
        }
        text.push_str("-- reconciler pass over the run\n");
        for (k, val) in report["reconciliation"].as_object().into_iter().flatten() {
            line(text, &format!("  {k}"), val.to_string());
        }
        if let Some(money) = report["money"].as_object() {
            text.push_str("-- money campaign (another product on the account, refunds on)\n");
            for section in money.values() {
                for (k, val) in section.as_object().into_iter().flatten() {
                    line(text, &format!("  {k}"), val.to_string());
                }
            }
        }
    }

    /// Why invariant `id` is not checked in this run's mode, if it is not.
    fn unchecked(&self, id: &str) -> Option<&'static str> {
        if self.money.is_none() && crate::money_checks::INVARIANTS.contains(&id) {
            Some("no --money")
        } else if !self.args.rolling && crate::invariants::rolling::INVARIANTS.contains(&id) {
            Some("no --rolling")
        } else if !self.args.ha && crate::invariants::failover::HA_INVARIANTS.contains(&id) {
            Some("no --ha")
        } else if self.args.no_crash_points && id == "crash_points_fired" {
            Some("crash points not armed")
        } else {
            None
        }
    }

    /// Every invariant: PASS, FAIL with its count and its first violations (the end of a CI
    /// log is often all that is kept, and the violations are printed long before it), or not
    /// checked in this mode.
    fn text_invariants(&self, text: &mut String) {
        text.push_str("-- invariants\n");
        for (id, what) in &INVARIANTS {
            let n = self
                .verdict
                .violations
                .by_invariant
                .get(id)
                .copied()
                .unwrap_or(0);
            line(
                text,
                &format!("  {what}"),
                if let Some(why) = self.unchecked(id) {
                    format!("not checked ({why})")
                } else if n == 0 {
                    "PASS".to_owned()
                } else {
                    format!("FAIL ({n})")
                },
            );
            for violation in self.verdict.violations.first_of(id, 3) {
                text.push_str(&format!("    {violation}\n"));
            }
        }
    }
}

/// One `key  value` line of the report.
fn line(text: &mut String, k: &str, val: String) {
    text.push_str(&format!("{k:<58} {val}\n"));
}

/// A titled section of counts.
fn section<K: std::fmt::Display, N: std::fmt::Display>(
    text: &mut String,
    title: &str,
    counts: impl IntoIterator<Item = (K, N)>,
) {
    text.push_str(&format!("-- {title}\n"));
    for (k, n) in counts {
        line(text, &format!("  {k}"), n.to_string());
    }
}

/// The reconciler's pass and its findings by kind, for the report.
fn reconciliation_json(found: &crate::reconciliation::Reconciliation) -> Value {
    let by_kind = found
        .findings
        .iter()
        .fold(BTreeMap::<String, u64>::new(), |mut m, f| {
            *m.entry(f.kind.clone()).or_default() += 1;
            m
        });
    json!({
        "summary": match &found.summary {
            Ok(summary) => summary.clone(),
            Err(error) => json!({ "error": error }),
        },
        "findings_by_kind": by_kind,
    })
}
