//! The completer's and reaper's `--once` passes: every 2 s while traffic runs (they must work
//! under faults too), then the drains that let the system finish what the clients left (the
//! completer until no key is unfinished, then the enqueuer and receipt worker until every
//! receipt is mailed), each bounded so that a system that never settles fails the invariants
//! instead of hanging the campaign.

use std::{
    fs::OpenOptions,
    path::Path,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use diesel_async::AsyncPgConnection;
use serde_json::Value;
use tokio::{process::Command, task::JoinHandle};

use crate::{
    args::Args,
    counters::Counters,
    evidence::{count, read_mail},
    faults::sleep_unless_stopped,
    setup::{Plan, Wiring},
};

/// Runs `workers <what> --once`; its summary is the last JSON object it prints.
pub(crate) async fn run_once(
    bin: &Path,
    what: &str,
    env: &[(String, String)],
    log: &Path,
) -> anyhow::Result<Value> {
    run_once_with(bin, &[what, "--once"], env, log).await
}

/// Runs `workers <args…>` (a `--once` pass); its summary is the last JSON object it prints.
pub(crate) async fn run_once_with(
    bin: &Path,
    args: &[&str],
    env: &[(String, String)],
    log: &Path,
) -> anyhow::Result<Value> {
    let what = args.join(" ");
    let err = OpenOptions::new().create(true).append(true).open(log)?;
    let child = Command::new(bin)
        .args(args)
        .envs(env.iter().cloned())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err))
        .kill_on_drop(true)
        .spawn()?;
    let output = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
        .await
        .context("--once pass timed out")??;
    if !output.status.success() {
        bail!("workers {what}: {}", output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{'));
    Ok(line
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null))
}

/// Adds a pass's numeric summary fields to `totals`, as `<prefix>.<field>`.
fn accumulate(totals: &Counters, prefix: &str, summary: &Value) {
    if let Some(map) = summary.as_object() {
        for (k, v) in map {
            if let Some(n) = v.as_u64() {
                totals.add(format!("{prefix}.{k}"), n);
            }
        }
    }
}

/// One `workers <what> --once` pass, counted (with what it did) in `maintenance`.
async fn pass(
    bin: &Path,
    what: &str,
    env: &[(String, String)],
    log: &Path,
    maintenance: &Counters,
) {
    match run_once(bin, what, env, log).await {
        Ok(v) => {
            maintenance.add(format!("{what}.passes"), 1);
            accumulate(maintenance, what, &v);
        }
        Err(_) => maintenance.add(format!("{what}.failed_passes"), 1),
    }
}

/// Periodic completer / reaper passes (they also run during faults).
pub(crate) struct Maintainer {
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Maintainer {
    pub(crate) fn start(plan: &Plan, wiring: &Wiring, maintenance: &Arc<Counters>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (maint, stop_task, env) = (
            Arc::clone(maintenance),
            Arc::clone(&stop),
            wiring.env.clone(),
        );
        let (bin, log) = (
            plan.bin_dir.join("workers"),
            plan.log_dir.join("completer.log"),
        );
        let rlog = plan.log_dir.join("reaper.log");
        let task = tokio::spawn(async move {
            while sleep_unless_stopped(&stop_task, Duration::from_secs(2)).await {
                pass(&bin, "completer", &env, &log, &maint).await;
                pass(&bin, "reaper", &env, &rlog, &maint).await;
            }
        });
        Maintainer { stop, task }
    }

    pub(crate) async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
    }
}

/// How the drains ended, for the report.
pub(crate) struct Drain {
    pub(crate) completer: Duration,
    pub(crate) receipts: Duration,
    pub(crate) unfinished: i64,
    pub(crate) staged: i64,
}

/// Both drains, timed from `clients_done`.
pub(crate) async fn drain(
    args: &Args,
    plan: &Plan,
    wiring: &Wiring,
    conn: &mut AsyncPgConnection,
    maintenance: &Counters,
    clients_done: Instant,
) -> anyhow::Result<Drain> {
    let unfinished = drain_completer(args, plan, wiring, conn, maintenance).await?;
    let completer = clients_done.elapsed();
    println!(
        "proof: completer drain {:.1}s, unfinished keys left {unfinished}",
        completer.as_secs_f64()
    );
    let staged = drain_receipts(args, plan, conn).await?;
    let receipts = clients_done.elapsed() - completer;
    println!(
        "proof: receipts drain {:.1}s (staged {}, finished charged rides {}, sent {})",
        receipts.as_secs_f64(),
        staged.staged,
        staged.charged,
        staged.sent
    );
    Ok(Drain {
        completer,
        receipts,
        unfinished,
        staged: staged.staged,
    })
}

/// Drain 1: the completer until no key is unfinished (bounded); the unfinished keys left.
async fn drain_completer(
    args: &Args,
    plan: &Plan,
    wiring: &Wiring,
    conn: &mut AsyncPgConnection,
    maintenance: &Counters,
) -> anyhow::Result<i64> {
    let workers_bin = plan.bin_dir.join("workers");
    // A key a stalled api-server held waits for the lock timeout (a paused holder's lock is
    // live); the drain outlasts it, whatever the lock timeout in force.
    let base = Duration::from_secs(if args.long { 120 } else { 45 });
    let completer_deadline =
        Instant::now() + base.max(Duration::from_secs(args.lock_timeout_secs() + 30));
    let mut unfinished = -1;
    while Instant::now() < completer_deadline {
        unfinished = count(
            conn,
            "SELECT count(*) AS n FROM idempotency_keys WHERE recovery_point <> 'finished' \
             AND completer_gave_up_at IS NULL",
        )
        .await?;
        if unfinished == 0 {
            break;
        }
        pass(
            &workers_bin,
            "completer",
            &wiring.env,
            &plan.log_dir.join("completer.log"),
            maintenance,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    Ok(unfinished)
}

/// Where the receipts drain stopped.
struct ReceiptsLeft {
    staged: i64,
    charged: i64,
    sent: i64,
}

/// Drain 2: enqueuer and receipts, for as long as receipts keep going out: a run without faults
/// (`--rolling`) ends its traffic with thousands still to mail at the worker's few hundred a
/// second, so a fixed wait would stop with thousands unmailed and fail `one_receipt`.
/// It stops once everything charged is sent and mailed, after a stall of 40 s (120 s `--long`)
/// without a new receipt sent, or after ten minutes in all.
async fn drain_receipts(
    args: &Args,
    plan: &Plan,
    conn: &mut AsyncPgConnection,
) -> anyhow::Result<ReceiptsLeft> {
    let stall_limit = Duration::from_secs(if args.long { 120 } else { 40 });
    let give_up = Instant::now() + Duration::from_secs(600);
    let (mut last_sent, mut last_progress) = (-1, Instant::now());
    let left = loop {
        let staged = count(conn, "SELECT count(*) AS n FROM staged_jobs").await?;
        let charged = count(
            conn,
            "SELECT count(*) AS n FROM rides r JOIN idempotency_keys k ON k.id = r.idempotency_key_id \
             WHERE r.stripe_charge_id IS NOT NULL AND k.recovery_point = 'finished'",
        )
        .await?;
        let sent = count(conn, "SELECT count(*) AS n FROM sent_receipts").await?;
        let left = ReceiptsLeft {
            staged,
            charged,
            sent,
        };
        // The mail directory is read only once the database says everything went out: reading
        // tens of thousands of files every half second would slow the very worker waited for.
        if staged == 0 && sent >= charged {
            let mails: usize = read_mail(&plan.mail_dir)?.0.values().map(Vec::len).sum();
            if mails as i64 >= sent {
                break left;
            }
        }
        if sent > last_sent {
            (last_sent, last_progress) = (sent, Instant::now());
        }
        if last_progress.elapsed() > stall_limit || Instant::now() > give_up {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // Let a straggling duplicate (if any) land before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(left)
}
