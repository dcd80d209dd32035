//! `--rolling`'s rolling deploys, the campaign's alternative to faults: every process replaced one
//! at a time, as a Deployment's rolling update replaces its pods.

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::{Duration, Instant},
};

use tokio::sync::Mutex;

use crate::{
    args::Args,
    counters::Counters,
    processes::{Children, Proc, TERMINATION_GRACE, Terminated},
    setup::{Plan, Wiring},
};

use super::{FaultTask, sleep_unless_stopped};

/// Starts `--rolling`'s rollouts of `children` during the traffic, with this build's binaries
/// (and, with `--rolling-from`, this build's migrations first).
pub(super) fn start(
    args: &Args,
    plan: &Plan,
    wiring: &Wiring,
    children: &Children,
    faults: &Arc<Counters>,
    stop: &Arc<AtomicBool>,
) -> FaultTask {
    tokio::spawn(rolling_deploys(Rollouts {
        procs: children.rollout_order(),
        bin_dir: plan.bin_dir.clone(),
        migrate_env: args.rolling_from.is_some().then(|| wiring.env.clone()),
        faults: Arc::clone(faults),
        stop: Arc::clone(stop),
        traffic: plan.duration,
        rollouts: args.rollouts,
    }))
}

/// What `--rolling` replaces, with what, and when.
struct Rollouts {
    procs: Vec<Arc<Mutex<Proc>>>,
    /// This build's binaries.
    bin_dir: std::path::PathBuf,
    /// `--rolling-from`: the environment this build's `api-server migrate` runs with, under
    /// traffic, before the first rollout (the schema starts as the older build left it).
    migrate_env: Option<Vec<(String, String)>>,
    faults: Arc<Counters>,
    stop: Arc<AtomicBool>,
    traffic: Duration,
    rollouts: u32,
}

/// `--rolling`: `rollouts` times, at even marks of the traffic, every process of `procs`
/// replaced one at a time, as a Deployment's rolling update replaces its pods: SIGTERM, its
/// drain and exit waited for, a new one started from this build's binary in `bin_dir` (the first
/// rollout of `--rolling-from` is the upgrade) and its port waited for, then a second for the
/// clients to reconnect before the next. The process's lock is held throughout, so the supervisor
/// never sees it dead. Counted as `rollout/<name>`, and `rollout_killed/<name>` for a process that
/// had to be killed after [`TERMINATION_GRACE`]. With `--rolling-from`, this build's migrations are
/// applied first, while the older build serves (the expand step of an expand/contract release:
/// the release's migrate Job runs before its rollout), counted as `migration/applied`.
async fn rolling_deploys(plan: Rollouts) -> anyhow::Result<()> {
    let Rollouts {
        procs,
        bin_dir,
        migrate_env,
        faults,
        stop,
        traffic,
        rollouts,
    } = plan;
    // Each round at its own mark of the traffic, whatever the last one took: a drain delay
    // lengthens every replacement.
    let gap = traffic / (rollouts + 1);
    let start = Instant::now();
    for round in 1..=rollouts {
        let due = (start + gap * round).saturating_duration_since(Instant::now());
        if !sleep_unless_stopped(&stop, due).await {
            break;
        }
        if round == 1
            && let Some(env) = &migrate_env
        {
            let started = std::time::Instant::now();
            crate::setup::migrate(&bin_dir.join("api-server"), env).await?;
            println!(
                "proof: this build's migrations applied under traffic in {:.1} s",
                started.elapsed().as_secs_f64()
            );
            faults.add("migration/applied", 1);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        println!("proof: rollout {round} of {rollouts}");
        for proc in &procs {
            let mut proc = proc.lock().await;
            let name = proc.name;
            match proc.terminate(TERMINATION_GRACE).await {
                Terminated::Exited(status) => println!("proof: rollout: {name} exited ({status})"),
                Terminated::Killed => faults.add(format!("rollout_killed/{name}"), 1),
                Terminated::NotRunning => println!("proof: rollout: {name} was not running"),
            }
            proc.use_build(&bin_dir);
            proc.start().await?;
            faults.add(format!("rollout/{name}"), 1);
            drop(proc);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    Ok(())
}
