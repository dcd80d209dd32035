//! The campaign's child processes and their supervision: how one is started (and armed with a
//! crash point), killed and reaped; the set the campaign runs ([`Children`]) and the
//! [`Supervisor`] that restarts whatever died by itself. Faults kill children through here too,
//! so a kill is always followed by a reap and a start that is counted when it fails.

use std::{
    collections::BTreeMap,
    fs::OpenOptions,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use rand::{Rng, SeedableRng, rngs::StdRng};
use tokio::{
    process::{Child, Command},
    sync::Mutex,
    task::JoinHandle,
};

use crate::{
    args::Args,
    counters::Counters,
    setup::{Plan, Wiring},
};

pub(crate) struct Proc {
    pub(crate) name: &'static str,
    bin: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    port: Option<u16>,
    child: Option<Child>,
    starts: u64,
    /// Arms one crash point per start (api-servers only).
    arming: Option<Arc<Arming>>,
}

/// Hands each api-server start the next crash point, round-robin, to fire on a random hit, so
/// that every point is crashed on purpose in every run. Disarmed for the final drain.
pub(crate) struct Arming {
    next: AtomicU64,
    pub(crate) armed: AtomicBool,
    rng: std::sync::Mutex<StdRng>,
    log: PathBuf,
    /// The armed point fires on a pass drawn from this range: late enough that a server spends
    /// most of its life serving, early enough that every point fires in the run (several times
    /// in a short one, dozens in a long one).
    after: (u64, u64),
}

impl Arming {
    fn env(&self) -> Vec<(String, String)> {
        if !AtomicBool::load(&self.armed, Ordering::SeqCst) {
            return Vec::new();
        }
        let points = api_server::fault::CrashPoint::ALL;
        let n = self.next.fetch_add(1, Ordering::SeqCst) as usize;
        let (low, high) = self.after;
        let after: u64 = self
            .rng
            .lock()
            .map_or(1, |mut r| r.random_range(low..=high));
        vec![
            (
                "FAULT_CRASH_POINT".to_owned(),
                points[n % points.len()].name().to_owned(),
            ),
            ("FAULT_CRASH_AFTER".to_owned(), after.to_string()),
            ("FAULT_CRASH_LOG".to_owned(), self.log.display().to_string()),
        ]
    }

    /// How often each point fired, from the log the api-servers append to as they crash.
    pub(crate) fn fired(&self) -> BTreeMap<String, u64> {
        self.crashes()
            .into_iter()
            .fold(BTreeMap::new(), |mut m, (point, _)| {
                *m.entry(point).or_default() += 1;
                m
            })
    }

    /// Every crash in the log: the point, and when (the wall clock, as the api-server wrote it).
    pub(crate) fn crashes(&self) -> Vec<(String, Option<std::time::SystemTime>)> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let point = fields.next()?.to_owned();
                let at = fields
                    .next()
                    .and_then(|ms| ms.parse::<u64>().ok())
                    .map(|ms| std::time::UNIX_EPOCH + Duration::from_millis(ms));
                Some((point, at))
            })
            .collect()
    }
}

impl Proc {
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    pub(crate) async fn start(&mut self) -> anyhow::Result<()> {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let err = out.try_clone()?;
        let armed = self.arming.as_ref().map(|a| a.env()).unwrap_or_default();
        let child = Command::new(&self.bin)
            .args(&self.args)
            .envs(self.env.iter().cloned())
            .envs(armed)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} ({})", self.name, self.bin.display()))?;
        self.child = Some(child);
        self.starts += 1;
        if let Some(port) = self.port
            && let Err(error) = self.wait_listening(port, Duration::from_secs(30)).await
        {
            // What the child was doing: a start that never listens has been seen a few times
            // in long campaigns, and its log was empty.
            let state = match self.exited() {
                Some(status) => format!("exited: {status}"),
                None => self
                    .pid()
                    .map_or_else(|| "no pid".to_owned(), process_state),
            };
            return Err(error.context(format!("{} did not listen on {port} ({state})", self.name)));
        }
        Ok(())
    }

    /// Until the child listens on `port`, or has exited: an armed api-server can reach its crash
    /// point within moments of listening (the completer's backlog arrives at once), between two
    /// polls. Its exit is then the supervisor's to see (counted as a self exit) and restart at its
    /// next tick, rather than a dead server waited for until the timeout.
    async fn wait_listening(&mut self, port: u16, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if port_in_use(port).await || self.exited().is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("port {port} not open after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL (tokio's `start_kill` sends SIGKILL on Unix) and reap.
    pub(crate) async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// The next start runs the same program from the build in `bin_dir` (a rollout's new build).
    pub(crate) fn use_build(&mut self, bin_dir: &Path) {
        if let Some(file) = self.bin.file_name() {
            self.bin = bin_dir.join(file);
        }
    }

    /// SIGTERM, as a rollout stops a pod, then up to `grace` for the process to drain and exit
    /// (SIGKILL after that): how it ended.
    pub(crate) async fn terminate(&mut self, grace: Duration) -> Terminated {
        let Some(mut child) = self.child.take() else {
            return Terminated::NotRunning;
        };
        if let Some(pid) = child.id() {
            signal(pid, "-TERM").await;
        }
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(Ok(status)) => Terminated::Exited(status.to_string()),
            Ok(Err(error)) => Terminated::Exited(format!("wait failed: {error}")),
            Err(_) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                Terminated::Killed
            }
        }
    }

    /// Whether the child died on its own (not by our kill).
    pub(crate) fn exited(&mut self) -> Option<String> {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(status))) => Some(status.to_string()),
            _ => None,
        }
    }
}

/// A running process's scheduler state and kernel wait channel, from `/proc`.
fn process_state(pid: u32) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses and may contain spaces.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("?")
        .to_owned();
    let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    format!("pid {pid}, state {state}, wchan {wchan}")
}

pub(crate) async fn port_in_use(port: u16) -> bool {
    tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_ok()
}

/// Kills `proc` as a fault (counted under `label`), waits `pause`, and starts it again.
pub(crate) async fn kill_and_restart(
    proc: &Mutex<Proc>,
    pause: Duration,
    faults: &Counters,
    label: &str,
) -> anyhow::Result<()> {
    let mut p = proc.lock().await;
    if let Some(status) = p.exited() {
        faults.add(format!("self_exit/{}", p.name), 1);
        eprintln!("proof: {} had exited on its own ({status})", p.name);
    }
    p.kill().await;
    faults.add(label, 1);
    tokio::time::sleep(pause).await;
    start_or_count(&mut p, faults).await;
    Ok(())
}

/// Starts `p`; a failure (say, while PostgreSQL is down) is counted and left to the supervisor,
/// which tries again.
async fn start_or_count(p: &mut Proc, faults: &Counters) {
    if let Err(error) = p.start().await {
        faults.add(format!("restart_failed/{}", p.name), 1);
        eprintln!("proof: cannot start {}: {error:#}", p.name);
        p.kill().await;
    }
}

/// Restarts any child that died by itself (a crash point, or a bug) or failed to start.
async fn supervise(procs: &[Arc<Mutex<Proc>>], faults: &Counters) {
    for proc in procs {
        let mut p = proc.lock().await;
        if let Some(status) = p.exited() {
            faults.add(format!("self_exit/{}", p.name), 1);
            if p.arming.is_none() {
                eprintln!("proof: {} exited on its own ({status})", p.name);
            }
            p.kill().await;
        }
        if p.child.is_none() {
            start_or_count(&mut p, faults).await;
        }
    }
}

/// How long a process stopped as a pod is (a rollout's, or the disarming at the end of traffic)
/// may take to drain and exit after SIGTERM: the api-server's in-flight CreateRides end within
/// the provider's timeout, the workers' within a batch or a mail.
pub(crate) const TERMINATION_GRACE: Duration = Duration::from_secs(45);

/// How [`Proc::terminate`] ended a process.
#[derive(Debug)]
pub(crate) enum Terminated {
    /// It exited by itself after SIGTERM, with this status.
    Exited(String),
    /// It was still running after its grace and was killed.
    Killed,
    NotRunning,
}

/// SIGSTOP / SIGCONT / SIGTERM by pid.
pub(crate) async fn signal(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .await
        .is_ok_and(|s| s.success())
}

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
            log: plan.out_dir.join("crash-points.log"),
            after: if args.long { (10, 80) } else { (3, 25) },
        }
    }
}

impl Children {
    /// Starts every child, each waited for (its port, when it listens on one) before the next.
    pub(crate) async fn start(args: &Args, plan: &Plan, wiring: &Wiring) -> anyhow::Result<Self> {
        // `--rolling-from`: the older build's binaries first; every rollout starts this build's.
        let first_bin = |name: &str| crate::setup::first_binary(args, plan, name);
        let workers_bin = first_bin("workers");
        let make = |name: &'static str, bin: PathBuf, a: Vec<String>, port: Option<u16>| Proc {
            name,
            bin,
            args: a,
            env: wiring.env.clone(),
            log: plan.log_dir.join(format!("{name}.log")),
            port,
            child: None,
            starts: 0,
            arming: None,
        };
        let arming = Arc::new(Arming::for_run(args, plan));
        let mut stripe = make(
            "fake-stripe",
            plan.bin_dir.join("fake-stripe"),
            vec!["--listen".into(), format!("127.0.0.1:{}", args.stripe_port)],
            Some(args.stripe_port),
        );
        stripe.start().await?;
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
        let mut sink = make(
            "mail-sink",
            plan.bin_dir.join("mail-sink"),
            sink_args,
            Some(args.smtp_port),
        );
        sink.start().await?;
        let mut api_a = make(
            "api-server",
            first_bin("api-server"),
            vec!["serve".into()],
            Some(args.grpc_port),
        );
        api_a.arming = Some(Arc::clone(&arming));
        // The second api-server has a pool of one connection for everything its share of the
        // clients sends: pool exhaustion, answered with UNAVAILABLE and retried.
        let mut api_b = make(
            "api-server-b",
            first_bin("api-server"),
            vec!["serve".into()],
            Some(args.grpc_port_b),
        );
        api_b.arming = Some(Arc::clone(&arming));
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
        let lb = if args.lb {
            let config = crate::load_balancer::write_config(args, plan, wiring)?;
            // `-db`: in the foreground, so that it is this campaign's child.
            let lb_args = vec!["-db".into(), "-f".into(), config.display().to_string()];
            let mut lb = make("haproxy", "haproxy".into(), lb_args, Some(args.lb_port));
            lb.start().await?;
            if let Some(status) = lb.exited() {
                bail!(
                    "haproxy exited at start ({status}); see {}",
                    lb.log.display()
                );
            }
            Some(lb)
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

/// Restarts whatever died by itself (crash points) until the very end.
pub(crate) struct Supervisor {
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Supervisor {
    pub(crate) fn start(children: &Children, faults: &Arc<Counters>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let procs = vec![
            Arc::clone(&children.api),
            Arc::clone(&children.api_b),
            Arc::clone(&children.enqueuer),
            Arc::clone(&children.receipts),
        ];
        let (faults, stop_task) = (Arc::clone(faults), Arc::clone(&stop));
        let task = tokio::spawn(async move {
            while !AtomicBool::load(&stop_task, Ordering::Relaxed) {
                supervise(&procs, &faults).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Supervisor { stop, task }
    }

    pub(crate) async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
    }
}
