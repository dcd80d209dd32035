//! A PostgreSQL cluster and a RabbitMQ node of the campaign's own, so that it can restart them
//! under load without disturbing anything else on the machine (the test suite, a `run.sh`
//! stack). Both come from the machine's Debian packages; when the binaries are missing the
//! campaign runs against the shared servers and reports those faults as skipped.
//! [`Services`] holds this run's servers, [`ServerKind`] names the one a fault restarts.
//!
//! With `--ha` the servers are instead the high-availability topology of `deploy/local/ha.sh`
//! ([`Ha`]): PostgreSQL under Patroni (a primary and a synchronous standby) and a three-node
//! RabbitMQ cluster, on ports and in a directory of the run's own. The script is the one home of
//! that topology; the campaign only asks it to start, break, wait for and stop it.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
};

use anyhow::{Context, bail};
use tokio::process::Command;
use workers::testing::RabbitNode;

/// Runs `program args` (as the `postgres` user when we are root: PostgreSQL refuses to run as
/// root) and fails with its output when it fails.
async fn run(program: &Path, args: &[&str], as_postgres: bool) -> anyhow::Result<()> {
    let mut command = if as_postgres {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    };
    let output = command
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {}", program.display()))?;
    if !output.status.success() {
        bail!(
            "{} {} failed: {}{}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

async fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .await
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

pub struct Postgres {
    bin: PathBuf,
    data: PathBuf,
    log: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl Postgres {
    /// The newest installed server's binaries (`/usr/lib/postgresql/<major>/bin`).
    pub fn find_binaries() -> Option<PathBuf> {
        let mut majors: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(Result::ok)
            .filter_map(|e| {
                let major = e.file_name().to_str()?.parse().ok()?;
                let bin = e.path().join("bin");
                bin.join("pg_ctl").exists().then_some((major, bin))
            })
            .collect();
        majors.sort();
        majors.pop().map(|(_, bin)| bin)
    }

    /// `initdb` into `dir` (trust auth on loopback) and start on `port`.
    pub async fn init_and_start(bin: PathBuf, dir: &Path, port: u16) -> anyhow::Result<Postgres> {
        let as_postgres = is_root().await;
        std::fs::create_dir_all(dir)?;
        if as_postgres {
            run(
                Path::new("chown"),
                &["postgres:postgres", &dir.display().to_string()],
                false,
            )
            .await?;
        }
        let data = dir.join("data");
        run(
            &bin.join("initdb"),
            &[
                "-D",
                &data.display().to_string(),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
            as_postgres,
        )
        .await?;
        let pg = Postgres {
            bin,
            log: dir.join("postgres.log"),
            data,
            port,
            as_postgres,
        };
        pg.start().await?;
        Ok(pg)
    }

    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub async fn start(&self) -> anyhow::Result<()> {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories='{}' -c max_connections=200",
            self.port,
            self.data.display()
        );
        run(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                &self.data.display().to_string(),
                "-l",
                &self.log.display().to_string(),
                "-o",
                &options,
                "-w",
                "-t",
                "60",
                "start",
            ],
            self.as_postgres,
        )
        .await
    }

    /// Fast shutdown: open transactions are rolled back, every session is cut.
    pub async fn stop_fast(&self) -> anyhow::Result<()> {
        self.stop("fast").await
    }

    /// A crash: immediate shutdown, every process quits without writing out what it holds, so
    /// WAL not yet flushed (commits made without waiting for the flush) is lost, and the restart
    /// runs crash recovery.
    pub async fn crash(&self) -> anyhow::Result<()> {
        self.stop("immediate").await
    }

    async fn stop(&self, mode: &str) -> anyhow::Result<()> {
        run(
            &self.bin.join("pg_ctl"),
            &[
                "-D",
                &self.data.display().to_string(),
                "-m",
                mode,
                "-w",
                "-t",
                "60",
                "stop",
            ],
            self.as_postgres,
        )
        .await
    }
}

/// The high-availability topology, driven through `deploy/local/ha.sh`.
pub struct Ha {
    script: PathBuf,
    dir: PathBuf,
    port_base: u16,
    /// The multi-host URL of the `postgres` database, `target_session_attrs=read-write`.
    pub admin_url: String,
    /// Every node's AMQP URL, comma-separated.
    pub amqp_url: String,
}

impl Ha {
    /// Starts the topology in `dir` on ports from `port_base` (etcd, Patroni, PostgreSQL,
    /// RabbitMQ: the script's header has the layout). Installs its Debian packages if absent.
    pub async fn up(dir: &Path, port_base: u16) -> anyhow::Result<Ha> {
        let mut ha = Ha {
            script: Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/ha.sh"),
            dir: dir.to_path_buf(),
            port_base,
            admin_url: String::new(),
            amqp_url: String::new(),
        };
        let urls = async {
            ha.script_output(&["up"]).await?;
            let admin_url = ha.script_output(&["database-url", "postgres"]).await?;
            anyhow::Ok((admin_url, ha.script_output(&["amqp-url"]).await?))
        };
        match urls.await {
            Ok((admin_url, amqp_url)) => {
                ha.admin_url = admin_url;
                ha.amqp_url = amqp_url;
                Ok(ha)
            }
            Err(error) => {
                ha.down().await;
                Err(error)
            }
        }
    }

    async fn script_output(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = Command::new(&self.script)
            .args(args)
            .env("HA_DIR", &self.dir)
            .env("HA_PORT_BASE", self.port_base.to_string())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .with_context(|| format!("running {}", self.script.display()))?;
        if !output.status.success() {
            bail!(
                "ha.sh {} failed: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    /// SIGKILL of the primary's postmaster; the node's name.
    pub async fn kill_primary(&self) -> anyhow::Result<String> {
        self.script_output(&["kill-primary"]).await
    }

    pub async fn switchover(&self) -> anyhow::Result<()> {
        self.script_output(&["switchover"]).await.map(drop)
    }

    /// SIGKILL of RabbitMQ node `node` (1–3).
    pub async fn kill_broker(&self, node: u8) -> anyhow::Result<()> {
        self.script_output(&["kill-broker", &node.to_string()])
            .await
            .map(drop)
    }

    pub async fn start_broker(&self, node: u8) -> anyhow::Result<()> {
        self.script_output(&["start-broker", &node.to_string()])
            .await
            .map(drop)
    }

    /// Until there is a primary with a synchronous standby and all three brokers listen.
    pub async fn wait_healthy(&self) -> anyhow::Result<()> {
        self.script_output(&["wait", "180"]).await.map(drop)
    }

    pub async fn down(&self) {
        if let Err(error) = self.script_output(&["down"]).await {
            eprintln!("proof: stopping the HA topology: {error:#}");
        }
    }
}

/// One of the private servers the campaign restarts.
#[derive(Clone, Copy)]
pub(crate) enum ServerKind {
    Postgres,
    Rabbit,
}

impl ServerKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            ServerKind::Postgres => "restart/postgresql (fast shutdown)",
            ServerKind::Rabbit => "restart/rabbitmq",
        }
    }

    /// The fault's name when PostgreSQL is crashed rather than stopped.
    pub(crate) const POSTGRES_CRASH_LABEL: &'static str =
        "restart/postgresql (crash: immediate shutdown)";

    /// How long the server stays down, in milliseconds.
    pub(crate) fn downtime_ms(self) -> std::ops::Range<u64> {
        match self {
            ServerKind::Postgres => 200..2500,
            ServerKind::Rabbit => 200..2000,
        }
    }
}

/// The private servers, if the campaign runs its own.
pub(crate) struct Services {
    pub(crate) pg: Option<Postgres>,
    pub(crate) rabbit: Option<RabbitNode>,
    /// `--ha`: instead of `pg` and `rabbit`.
    pub(crate) ha: Option<Ha>,
    pub(crate) dir: PathBuf,
}

impl Services {
    pub(crate) fn runs(&self, kind: ServerKind) -> bool {
        match kind {
            ServerKind::Postgres => self.pg.is_some(),
            ServerKind::Rabbit => self.rabbit.is_some(),
        }
    }

    /// Fast shutdown for PostgreSQL, or with `crash` an immediate one; a whole-node stop for
    /// RabbitMQ; nothing for a shared server.
    pub(crate) async fn stop_server(&self, kind: ServerKind, crash: bool) -> anyhow::Result<()> {
        match (kind, &self.pg, &self.rabbit) {
            (ServerKind::Postgres, Some(pg), _) if crash => pg.crash().await,
            (ServerKind::Postgres, Some(pg), _) => pg.stop_fast().await,
            (ServerKind::Rabbit, _, Some(rabbit)) => rabbit.stop().await,
            _ => Ok(()),
        }
    }

    pub(crate) async fn start_server(&self, kind: ServerKind) -> anyhow::Result<()> {
        match (kind, &self.pg, &self.rabbit) {
            (ServerKind::Postgres, Some(pg), _) => pg.start().await,
            (ServerKind::Rabbit, _, Some(rabbit)) => rabbit.start().await.map(drop),
            _ => Ok(()),
        }
    }

    pub(crate) async fn stop(&self, keep: bool) {
        if let Some(ha) = &self.ha {
            if keep {
                println!(
                    "proof: the HA topology keeps running in {}",
                    self.dir.display()
                );
                return;
            }
            ha.down().await;
        }
        if let Some(rabbit) = &self.rabbit
            && let Err(error) = rabbit.stop().await
        {
            eprintln!("proof: stopping RabbitMQ: {error:#}");
        }
        if let Some(pg) = &self.pg
            && let Err(error) = pg.stop_fast().await
        {
            eprintln!("proof: stopping PostgreSQL: {error:#}");
        }
        if keep {
            println!(
                "proof: kept the private servers' data in {}",
                self.dir.display()
            );
        } else if self.pg.is_some() || self.rabbit.is_some() || self.ha.is_some() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
