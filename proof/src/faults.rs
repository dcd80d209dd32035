//! The faults the campaign injects while traffic runs, each in a task of its own on a seeded
//! schedule (so `--seed` repeats a run's fault plan): api-server and worker SIGKILLs, api-server
//! stalls past the lock timeout, PostgreSQL and RabbitMQ restarts, and provider faults through
//! fake-stripe. `--ha`'s faults on the high-availability topology are [`ha`]'s, and `--rolling`'s
//! rolling deploys, which replace the faults, are [`rolling`]'s. Crash points are not here: the
//! api-servers fire them themselves, armed by [`crate::processes`].

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::json;
use tokio::{sync::Mutex, task::JoinHandle};

use crate::{
    args::Args,
    counters::{Counters, Tallies, Timeline},
    processes::{Children, Proc, kill_and_restart, signal},
    services::{ServerKind, Services},
    setup::{Plan, Wiring},
};

mod ha;
mod rolling;
pub(crate) use ha::{BROKER_KILL, PRIMARY_KILL, SWITCHOVER};

fn exp_delay(rng: &mut StdRng, mean_secs: f64) -> Duration {
    let u: f64 = rng.random_range(0.0001..1.0);
    Duration::from_secs_f64((-u.ln() * mean_secs).clamp(0.3, mean_secs * 4.0))
}

/// Rare faults (restarts, stalls) come first at a random point of the traffic window's middle,
/// so even a short run has each at least once; then every `mean_secs` on average.
fn rare_fault_delay(
    rng: &mut StdRng,
    first: &mut bool,
    traffic: Duration,
    mean_secs: f64,
) -> Duration {
    if std::mem::take(first) {
        traffic.mul_f64(rng.random_range(0.15..0.5))
    } else {
        exp_delay(rng, mean_secs)
    }
}

/// Sleeps `d`, or less if `stop` is set meanwhile; whether the caller should go on.
pub(crate) async fn sleep_unless_stopped(stop: &AtomicBool, d: Duration) -> bool {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50).min(end - Instant::now())).await;
    }
    !stop.load(Ordering::Relaxed)
}

type FaultTask = JoinHandle<anyhow::Result<()>>;

/// The running fault tasks, until traffic stops.
pub(crate) struct Faults {
    stop: Arc<AtomicBool>,
    /// In the order they are awaited: the first to have failed is the error reported.
    tasks: Vec<FaultTask>,
}

impl Faults {
    pub(crate) fn start(
        args: &Args,
        plan: &Plan,
        wiring: &Wiring,
        children: &Children,
        services: &Arc<Services>,
        tallies: &Tallies,
        http: &reqwest::Client,
    ) -> Self {
        let faults = &tallies.faults;
        let stop = Arc::new(AtomicBool::new(false));
        if args.rolling {
            return Faults {
                tasks: vec![rolling::start(args, plan, wiring, children, faults, &stop)],
                stop,
            };
        }
        let rng = |salt: u64| StdRng::seed_from_u64(plan.seed.wrapping_add(salt));
        // Fault: api-server SIGKILL + restart, at random moments.
        let apis = children.apis();
        let api_killer = kill_at_random(
            Arc::clone(faults),
            Some(Arc::clone(&tallies.timeline)),
            Arc::clone(&stop),
            args.api_kill_every_secs,
            rng(1),
            800,
            move |rng| {
                let server = rng.random_range(0..apis.len());
                (
                    Arc::clone(&apis[server]),
                    "sigkill/api-server (random moment)",
                    Some(server),
                )
            },
        );
        let staller = stall_apis(
            args.lock_timeout_secs(),
            children.apis(),
            tallies,
            Arc::clone(&stop),
            (!args.no_stalls).then_some(args.stall_every_secs),
            plan.duration,
            rng(5),
        );
        let (pg_restarter, rabbit_restarter) =
            server_faults(args, plan, services, tallies, &stop, rng);
        // Fault: enqueuer / receipt worker SIGKILL + restart.
        let (enq, rec) = (
            Arc::clone(&children.enqueuer),
            Arc::clone(&children.receipts),
        );
        let worker_killer = kill_at_random(
            Arc::clone(faults),
            None,
            Arc::clone(&stop),
            args.worker_kill_every_secs,
            rng(2),
            1000,
            move |rng| {
                if rng.random_bool(0.5) {
                    (Arc::clone(&enq), "sigkill/enqueuer", None)
                } else {
                    (Arc::clone(&rec), "sigkill/receipts", None)
                }
            },
        );
        let stripe_faulter = fault_provider(
            http.clone(),
            wiring.stripe_base.clone(),
            Arc::clone(faults),
            Arc::clone(&stop),
            args.stripe_fault_every_secs,
            rng(3),
        );
        Faults {
            tasks: vec![
                api_killer,
                worker_killer,
                stripe_faulter,
                staller,
                pg_restarter,
                rabbit_restarter,
            ],
            stop,
        }
    }

    /// Set when traffic stops (the progress line stops with the faults).
    pub(crate) fn stopped(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stop)
    }

    /// Stops every fault task and waits for it; the first that failed fails the campaign.
    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await??;
        }
        Ok(())
    }
}

/// Fault: PostgreSQL crash (immediate shutdown) or fast shutdown, alternately, and restart under
/// load; RabbitMQ stop and start during drains and consumption. On the `--ha` topology: primary
/// failovers and switchovers, and broker node kills. Returns the PostgreSQL and RabbitMQ tasks.
fn server_faults(
    args: &Args,
    plan: &Plan,
    services: &Arc<Services>,
    tallies: &Tallies,
    stop: &Arc<AtomicBool>,
    rng: impl Fn(u64) -> StdRng,
) -> (FaultTask, FaultTask) {
    let faults = &tallies.faults;
    if services.ha.is_some() {
        return ha::start(args, plan, services, tallies, stop, rng);
    }
    let restarter = |kind: ServerKind, mean: f64, salt: u64| {
        tokio::spawn(restart_at_random(
            Arc::clone(services),
            kind,
            Arc::clone(faults),
            Arc::clone(stop),
            rng(salt),
            plan.duration,
            mean,
        ))
    };
    (
        restarter(ServerKind::Postgres, args.pg_restart_every_secs, 6),
        restarter(ServerKind::Rabbit, args.rabbit_restart_every_secs, 7),
    )
}

/// SIGKILLs the child `pick` draws at random moments, and restarts it after a pause of up to
/// `max_pause_ms`; each kill is a holder's death on `deaths` when given (the api-servers, with
/// the number the clients know the one killed by).
fn kill_at_random(
    faults: Arc<Counters>,
    deaths: Option<Arc<Timeline>>,
    stop: Arc<AtomicBool>,
    mean: f64,
    mut rng: StdRng,
    max_pause_ms: u64,
    pick: impl Fn(&mut StdRng) -> (Arc<Mutex<Proc>>, &'static str, Option<usize>) + Send + 'static,
) -> FaultTask {
    tokio::spawn(async move {
        while sleep_unless_stopped(&stop, exp_delay(&mut rng, mean)).await {
            let pause = Duration::from_millis(rng.random_range(0..max_pause_ms));
            let (which, label, server) = pick(&mut rng);
            if let Some(deaths) = &deaths {
                deaths.death(label, server);
            }
            kill_and_restart(&which, pause, &faults, label).await?;
        }
        anyhow::Ok(())
    })
}

/// Fault: an api-server stalls (SIGSTOP) for longer than the lock timeout, then resumes. Its
/// in-flight attempts' keys are taken over by retries on the other api-server meanwhile;
/// when it resumes, their fencing tokens are gone.
fn stall_apis(
    lock_timeout_secs: u64,
    apis: [Arc<Mutex<Proc>>; 2],
    tallies: &Tallies,
    stop: Arc<AtomicBool>,
    mean: Option<f64>,
    traffic: Duration,
    mut rng: StdRng,
) -> FaultTask {
    let Some(mean) = mean else {
        return tokio::spawn(async { anyhow::Ok(()) });
    };
    let (faults, deaths) = (Arc::clone(&tallies.faults), Arc::clone(&tallies.timeline));
    let mut first = true;
    let lock_timeout = Duration::from_secs(lock_timeout_secs).as_secs_f64();
    tokio::spawn(async move {
        while sleep_unless_stopped(&stop, rare_fault_delay(&mut rng, &mut first, traffic, mean))
            .await
        {
            let server = rng.random_range(0..apis.len());
            let Some(pid) = apis[server].lock().await.pid() else {
                continue;
            };
            if signal(pid, "-STOP").await {
                faults.add(STALL, 1);
                deaths.death(STALL, Some(server));
                let stall = lock_timeout + rng.random_range(0.5..2.5);
                tokio::time::sleep(Duration::from_secs_f64(stall)).await;
                signal(pid, "-CONT").await;
            }
        }
        anyhow::Ok(())
    })
}

/// The label of an api-server's stall, as a fault and as a holder's death.
pub(crate) const STALL: &str = "stall/api-server SIGSTOP past the lock timeout";

/// Stops and starts `kind` at random moments until traffic stops; counts it as skipped when the
/// campaign runs on the shared server.
async fn restart_at_random(
    services: Arc<Services>,
    kind: ServerKind,
    faults: Arc<Counters>,
    stop: Arc<AtomicBool>,
    mut rng: StdRng,
    traffic: Duration,
    mean: f64,
) -> anyhow::Result<()> {
    if !services.runs(kind) {
        let name = kind.label().split(' ').next().unwrap_or_default();
        faults.add(format!("{name} SKIPPED (shared server)"), 1);
        return Ok(());
    }
    let mut first = true;
    let mut restarts = 0_u32;
    while sleep_unless_stopped(&stop, rare_fault_delay(&mut rng, &mut first, traffic, mean)).await {
        // Every other PostgreSQL restart, the first included, is a crash (immediate shutdown):
        // connections are cut mid-statement and only flushed commits survive, and every invariant
        // must still hold.
        let crash = matches!(kind, ServerKind::Postgres) && restarts.is_multiple_of(2);
        restarts += 1;
        services.stop_server(kind, crash).await?;
        let label = if crash {
            ServerKind::POSTGRES_CRASH_LABEL
        } else {
            kind.label()
        };
        faults.add(label, 1);
        tokio::time::sleep(Duration::from_millis(rng.random_range(kind.downtime_ms()))).await;
        services.start_server(kind).await?;
    }
    Ok(())
}

/// Fault: provider faults through fake-stripe's HTTP API.
fn fault_provider(
    http: reqwest::Client,
    base: String,
    faults: Arc<Counters>,
    stop: Arc<AtomicBool>,
    mean: f64,
    mut rng: StdRng,
) -> FaultTask {
    tokio::spawn(async move {
        while sleep_unless_stopped(&stop, exp_delay(&mut rng, mean)).await {
            // `slow`: the charge completes 8 s later, past the api-server's Stripe timeout and its
            // key lock, so retries take the key over while the first charge is still running.
            let mode = ["error_500", "timeout", "charge_then_drop", "slow"][rng.random_range(0..4)];
            let n: u64 = rng.random_range(1..=3);
            let ok = http
                .post(format!("{base}/_faults"))
                .json(&json!({"mode": mode, "count": n}))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                faults.add(format!("stripe/{mode} (injections)"), 1);
                faults.add(format!("stripe/{mode} (calls faulted, requested)"), n);
            } else {
                faults.add("stripe/injection_failed", 1);
            }
        }
        anyhow::Ok(())
    })
}

/// Takes back any provider fault not yet consumed, so that the drain runs against a healthy
/// provider.
pub(crate) async fn clear_provider_faults(http: &reqwest::Client, stripe_base: &str) {
    let _ = http.delete(format!("{stripe_base}/_faults")).send().await;
}
