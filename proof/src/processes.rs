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
use rand::{Rng, rngs::StdRng};
use tokio::{
    process::{Child, Command},
    sync::Mutex,
    task::JoinHandle,
};

use crate::counters::Counters;

mod children;
pub(crate) use children::{API_SERVERS, Children};

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
    /// Where each api-server appends its crashes: `crash-points-<name>.log` in it, one file per
    /// server, so that a crash is known to be that server's death.
    dir: PathBuf,
    /// The armed point fires on a pass drawn from this range: late enough that a server spends
    /// most of its life serving, early enough that every point fires in the run (several times
    /// in a short one, dozens in a long one).
    after: (u64, u64),
}

impl Arming {
    fn env(&self, server: &str) -> Vec<(String, String)> {
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
            (
                "FAULT_CRASH_LOG".to_owned(),
                self.log_of(server).display().to_string(),
            ),
        ]
    }

    /// How often each point fired, from the log the api-servers append to as they crash.
    pub(crate) fn fired(&self) -> BTreeMap<String, u64> {
        self.crashes()
            .into_iter()
            .fold(BTreeMap::new(), |mut m, crash| {
                *m.entry(crash.point).or_default() += 1;
                m
            })
    }

    /// Every crash in the logs: which api-server (numbered as the clients number them, see
    /// [`API_SERVERS`]), the point, and when (the wall clock, as the api-server wrote it).
    pub(crate) fn crashes(&self) -> Vec<Crash> {
        let mut crashes = Vec::new();
        for (server, name) in API_SERVERS.iter().enumerate() {
            let text = std::fs::read_to_string(self.log_of(name)).unwrap_or_default();
            crashes.extend(text.lines().filter_map(|line| {
                let mut fields = line.split_whitespace();
                let point = fields.next()?.to_owned();
                let at = fields
                    .next()
                    .and_then(|ms| ms.parse::<u64>().ok())
                    .map(|ms| std::time::UNIX_EPOCH + Duration::from_millis(ms));
                Some(Crash { server, point, at })
            }));
        }
        crashes
    }

    fn log_of(&self, server: &str) -> PathBuf {
        self.dir.join(format!("crash-points-{server}.log"))
    }
}

/// One crash point that fired.
pub(crate) struct Crash {
    /// The api-server that crashed, as the clients number it.
    pub(crate) server: usize,
    pub(crate) point: String,
    pub(crate) at: Option<std::time::SystemTime>,
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
        let armed = self
            .arming
            .as_ref()
            .map(|a| a.env(self.name))
            .unwrap_or_default();
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
