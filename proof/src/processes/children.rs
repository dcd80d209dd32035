//! The set of child processes the campaign runs ([`Children`]): how each is configured and armed,
//! started in order, handed out to the faults and rollouts, disarmed and killed at the end.

use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use anyhow::bail;
use rand::{SeedableRng, rngs::StdRng};
use tokio::sync::Mutex;

use crate::{
    args::Args,
    counters::Counters,
    setup::{Plan, Wiring},
};

use super::{Arming, Proc, TERMINATION_GRACE, Terminated, signal};

/// The api-servers' names, in the order the clients number them (an attempt's target) and the
/// faults pick them.
pub(crate) const API_SERVERS: [&str; 2] = ["api-server", "api-server-b"];

/// The children of one run. fake-stripe and the mail sink hold the evidence and are never
/// faulted, so the campaign owns them; the api-servers and workers are shared (behind a lock)
/// with the fault tasks that kill them and the supervisor that restarts them.
pub(crate) struct Children {
    stripe: Proc,
    sink: Proc,
    pub(crate) api: Arc<Mutex<Proc>>,
    pub(crate) api_b: Arc<Mutex<Proc>>,
    pub(crate) enqueuer: Arc<Mutex<Proc>>,
    pub(crate) receipts: Arc<Mutex<Proc>>,
    /// `--lb`: the proxy in front of both api-servers.
    lb: Option<Proc>,
    /// Hands the api-servers their crash points; read again for the report of what fired.
    pub(crate) arming: Arc<Arming>,
}

/// The second api-server's settings: its own port, and (but at the production defaults) one
/// pooled connection that times out after 100 ms.
fn api_b_env(args: &Args) -> Vec<(String, String)> {
    let pool_of_one = [
        ("DATABASE_POOL_SIZE", "1"),
        ("DATABASE_POOL_TIMEOUT_MS", "100"),
    ];
    let port = (
        "GRPC_LISTEN_ADDR",
        format!("127.0.0.1:{}", args.grpc_port_b),
    );
    std::iter::once(port)
        .chain(
            pool_of_one
                .iter()
                .filter(|_| !args.production_defaults)
                .map(|(k, v)| (*k, (*v).to_owned())),
        )
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
}

impl Arming {
    /// Armed unless `--no-crash-points`; the countdowns are drawn from the run's seed.
    fn for_run(args: &Args, plan: &Plan) -> Arming {
        Arming {
            next: AtomicU64::new(0),
            armed: AtomicBool::new(!args.no_crash_points),
            rng: std::sync::Mutex::new(StdRng::seed_from_u64(plan.seed.wrapping_add(4))),
            dir: plan.out_dir.clone(),
            after: if args.long { (10, 80) } else { (3, 25) },
        }
    }
}

impl Children {
    /// Starts every child, each waited for (its port, when it listens on one) before the next.
    pub(crate) async fn start(args: &Args, plan: &Plan, wiring: &Wiring) -> anyhow::Result<Self> {
        // `--rolling-from`: the older build's binaries first; every rollout starts this build's.
        let workers_bin = crate::setup::first_binary(args, plan, "workers");
        let make = |name: &'static str, bin: PathBuf, a: Vec<String>, port: Option<u16>| {
            child(plan, wiring, name, bin, a, port)
        };
        let arming = Arc::new(Arming::for_run(args, plan));
        let mut stripe = make(
            "fake-stripe",
            plan.bin_dir.join("fake-stripe"),
            vec!["--listen".into(), format!("127.0.0.1:{}", args.stripe_port)],
            Some(args.stripe_port),
        );
        stripe.start().await?;
        let mut sink = make(
            "mail-sink",
            plan.bin_dir.join("mail-sink"),
            sink_args(args, plan),
            Some(args.smtp_port),
        );
        sink.start().await?;
        let (api, api_b) = start_apis(args, plan, wiring, &arming).await?;
        let lb = if args.lb {
            Some(start_lb(args, plan, wiring).await?)
        } else {
            None
        };
        let enqueuer = Arc::new(Mutex::new(make(
            "enqueuer",
            workers_bin.clone(),
            vec!["enqueuer".into()],
            None,
        )));
        enqueuer.lock().await.start().await?;
        let receipts = Arc::new(Mutex::new(make(
            "receipts",
            workers_bin.clone(),
            vec!["receipts".into()],
            None,
        )));
        receipts.lock().await.start().await?;
        Ok(Children {
            stripe,
            sink,
            api,
            api_b,
            enqueuer,
            receipts,
            lb,
            arming,
        })
    }

    /// The order a rollout replaces processes in: the api-servers, then the workers.
    pub(crate) fn rollout_order(&self) -> Vec<Arc<Mutex<Proc>>> {
        vec![
            Arc::clone(&self.api),
            Arc::clone(&self.api_b),
            Arc::clone(&self.enqueuer),
            Arc::clone(&self.receipts),
        ]
    }

    /// Both api-servers; each client attempt and each api-server fault picks one.
    pub(crate) fn apis(&self) -> [Arc<Mutex<Proc>>; 2] {
        [Arc::clone(&self.api), Arc::clone(&self.api_b)]
    }

    /// Disarm for the drain and the replays: an api-server that was started with a crash point
    /// is replaced by one without, as a rollout replaces it (SIGTERM, its drain, a new start), so
    /// that the calls in flight as traffic ends are answered. A SIGKILL here would leave every key
    /// those calls had claimed locked for the lock timeout (90 s at the production defaults),
    /// longer than their clients retry. A server never armed (`--no-crash-points`, `--rolling`)
    /// is left serving.
    pub(crate) async fn disarm(&self, faults: &Counters) -> anyhow::Result<()> {
        let was_armed = self.arming.armed.swap(false, Ordering::SeqCst);
        for proc in &self.apis() {
            let mut p = proc.lock().await;
            if let Some(pid) = p.pid() {
                // A stalled server must not stay stopped (SIGCONT is harmless otherwise).
                signal(pid, "-CONT").await;
            }
            let exited = p.exited().is_some();
            if exited {
                faults.add(format!("self_exit/{}", p.name), 1);
            }
            if !was_armed && !exited {
                continue;
            }
            if let Terminated::Killed = p.terminate(TERMINATION_GRACE).await {
                faults.add(format!("disarm_killed/{}", p.name), 1);
            }
            p.start().await?;
        }
        Ok(())
    }

    /// Stop every child before judging (the database and ledger are read).
    pub(crate) async fn kill_all(&mut self) {
        self.api.lock().await.kill().await;
        self.api_b.lock().await.kill().await;
        self.enqueuer.lock().await.kill().await;
        self.receipts.lock().await.kill().await;
        self.sink.kill().await;
        self.stripe.kill().await;
        if let Some(lb) = &mut self.lb {
            lb.kill().await;
        }
    }
}

/// A child of the run, not started: the run's environment, its log in the run's log directory.
fn child(
    plan: &Plan,
    wiring: &Wiring,
    name: &'static str,
    bin: PathBuf,
    args: Vec<String>,
    port: Option<u16>,
) -> Proc {
    Proc {
        name,
        bin,
        args,
        env: wiring.env.clone(),
        log: plan.log_dir.join(format!("{name}.log")),
        port,
        child: None,
        starts: 0,
        arming: None,
    }
}

/// The mail sink's command line: SMTP and search ports, the mail directory, and with
/// `--tls-dir` the api-servers' certificate for STARTTLS.
fn sink_args(args: &Args, plan: &Plan) -> Vec<String> {
    let mut sink_args = vec![
        "--listen".into(),
        format!("127.0.0.1:{}", args.smtp_port),
        "--dir".into(),
        plan.mail_dir.display().to_string(),
        "--http-listen".into(),
        format!("127.0.0.1:{}", args.mail_search_port),
    ];
    if let Some(dir) = &args.tls_dir {
        // STARTTLS with the api-servers' certificate: the workers' SMTP_URL requires it.
        for (flag, file) in [("--tls-cert", "server.pem"), ("--tls-key", "server.key")] {
            sink_args.extend([flag.into(), dir.join(file).display().to_string()]);
        }
    }
    sink_args
}

/// Starts both api-servers, armed with the run's crash points (behind the proxy's settings
/// with `--lb`).
async fn start_apis(
    args: &Args,
    plan: &Plan,
    wiring: &Wiring,
    arming: &Arc<Arming>,
) -> anyhow::Result<(Arc<Mutex<Proc>>, Arc<Mutex<Proc>>)> {
    let first_bin = |name: &str| crate::setup::first_binary(args, plan, name);
    let mut api_a = child(
        plan,
        wiring,
        API_SERVERS[0],
        first_bin("api-server"),
        vec!["serve".into()],
        Some(args.grpc_port),
    );
    api_a.arming = Some(Arc::clone(arming));
    // The second api-server has a pool of one connection for everything its share of the
    // clients sends: pool exhaustion, answered with UNAVAILABLE and retried.
    let mut api_b = child(
        plan,
        wiring,
        API_SERVERS[1],
        first_bin("api-server"),
        vec!["serve".into()],
        Some(args.grpc_port_b),
    );
    api_b.arming = Some(Arc::clone(arming));
    api_b.env.extend(api_b_env(args));
    if args.lb {
        for api in [&mut api_a, &mut api_b] {
            api.env.extend(crate::load_balancer::api_env());
        }
    }
    let api = Arc::new(Mutex::new(api_a));
    let api_b = Arc::new(Mutex::new(api_b));
    api.lock().await.start().await?;
    api_b.lock().await.start().await?;
    Ok((api, api_b))
}

/// `--lb`: starts HAProxy in front of both api-servers, failing if it exits at once.
async fn start_lb(args: &Args, plan: &Plan, wiring: &Wiring) -> anyhow::Result<Proc> {
    let config = crate::load_balancer::write_config(args, plan, wiring)?;
    // `-db`: in the foreground, so that it is this campaign's child.
    let lb_args = vec!["-db".into(), "-f".into(), config.display().to_string()];
    let mut lb = child(
        plan,
        wiring,
        "haproxy",
        "haproxy".into(),
        lb_args,
        Some(args.lb_port),
    );
    lb.start().await?;
    if let Some(status) = lb.exited() {
        bail!(
            "haproxy exited at start ({status}); see {}",
            lb.log.display()
        );
    }
    Ok(lb)
}
