//! A RabbitMQ node of a test's or a campaign's own (feature `testing`): the machine's Debian
//! `rabbitmq-server`, its name, port, configuration and data in a directory of the caller's, so
//! it can be broken, restarted or given a TLS listener without touching the shared broker. The
//! crash-and-fault campaign restarts one under load; the fleet tests prove the workers over its
//! `amqps://` listener.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";

/// How long a node may take to open its listener: an Erlang boot on a loaded 2-core machine
/// has been seen to take tens of seconds.
const BOOT_TIMEOUT: Duration = Duration::from_secs(90);

/// The PEM files of a node's TLS listener.
#[derive(Clone, Debug)]
pub struct NodeTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA a client trusts; named in [`RabbitNode::url`]'s `cacertfile`.
    pub ca: PathBuf,
}

pub struct RabbitNode {
    dir: PathBuf,
    port: u16,
    dist_port: u16,
    node: String,
    tls: Option<NodeTls>,
}

impl RabbitNode {
    pub fn available() -> bool {
        Path::new(RABBIT_BIN).join("rabbitmq-server").exists()
    }

    /// Writes the configuration of a node called `name`@localhost with no plugins, its data in
    /// `dir`, listening on 127.0.0.1:`port` only: plain AMQP, or with `tls` AMQP over TLS and
    /// nothing in the clear. Erlang distribution listens on `dist_port`.
    pub fn configure(
        dir: &Path,
        name: &str,
        port: u16,
        dist_port: u16,
        tls: Option<NodeTls>,
    ) -> std::io::Result<RabbitNode> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("enabled_plugins"), "[].\n")?;
        std::fs::write(dir.join("rabbitmq-env.conf"), "")?;
        let listener = match &tls {
            None => format!("listeners.tcp.1 = 127.0.0.1:{port}\n"),
            Some(tls) => format!(
                "listeners.tcp = none\n\
                 listeners.ssl.1 = 127.0.0.1:{port}\n\
                 ssl_options.certfile = {}\n\
                 ssl_options.keyfile = {}\n\
                 ssl_options.cacertfile = {}\n\
                 ssl_options.verify = verify_none\n\
                 ssl_options.fail_if_no_peer_cert = false\n",
                tls.cert.display(),
                tls.key.display(),
                tls.ca.display()
            ),
        };
        // Tests and the campaign log in as guest from loopback only; the listener binds nothing
        // else.
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("{listener}loopback_users = none\n"),
        )?;
        Ok(RabbitNode {
            dir: dir.to_path_buf(),
            port,
            dist_port,
            node: format!("{name}@localhost"),
            tls,
        })
    }

    /// The node's URL for the workers: `amqps://…?cacertfile=` with TLS.
    pub fn url(&self) -> String {
        match &self.tls {
            None => format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port),
            Some(tls) => self.url_trusting(&tls.ca),
        }
    }

    /// The node's `amqps://` URL verified against the CA in `ca` (a test's wrong CA, say).
    pub fn url_trusting(&self, ca: &Path) -> String {
        format!(
            "amqps://guest:guest@127.0.0.1:{}/%2f?cacertfile={}",
            self.port,
            ca.display()
        )
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        let d = |name: &str| self.dir.join(name).display().to_string();
        vec![
            ("RABBITMQ_NODENAME", self.node.clone()),
            ("RABBITMQ_CONF_ENV_FILE", d("rabbitmq-env.conf")),
            ("RABBITMQ_CONFIG_FILE", d("rabbitmq.conf")),
            ("RABBITMQ_ADVANCED_CONFIG_FILE", d("advanced.config")),
            ("RABBITMQ_ENABLED_PLUGINS_FILE", d("enabled_plugins")),
            ("RABBITMQ_MNESIA_BASE", d("mnesia")),
            ("RABBITMQ_LOG_BASE", d("log")),
            ("RABBITMQ_PID_FILE", d("pid")),
            ("RABBITMQ_DIST_PORT", self.dist_port.to_string()),
            ("ERL_EPMD_ADDRESS", "127.0.0.1".to_owned()),
        ]
    }

    /// Starts the node and waits for its listener. The node is not tied to the returned handle:
    /// dropping it leaves the node running (a campaign stops and starts the same node), so
    /// [`RabbitNode::stop`] or [`RabbitNode::kill`] ends it.
    pub async fn start(&self) -> anyhow::Result<Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.out"))?;
        let child = Command::new(Path::new(RABBIT_BIN).join("rabbitmq-server"))
            .envs(self.env())
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .context("starting rabbitmq-server")?;
        let deadline = tokio::time::Instant::now() + BOOT_TIMEOUT;
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "RabbitMQ node {} not listening on {} after {BOOT_TIMEOUT:?}; see {}",
                    self.node,
                    self.port,
                    self.dir.join("server.out").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(child)
    }

    /// A clean stop of the whole node (`rabbitmqctl stop`): every connection is closed.
    pub async fn stop(&self) -> anyhow::Result<()> {
        let output = Command::new(Path::new(RABBIT_BIN).join("rabbitmqctl"))
            .args(["-n", &self.node, "stop"])
            .envs(self.env())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await?;
        if !output.status.success() {
            bail!(
                "rabbitmqctl stop failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }

    /// SIGKILLs the node's Erlang VM (the pid it wrote once booted), for a test's teardown,
    /// which must not wait for a clean stop and may run while unwinding from a panic.
    pub fn kill(&self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", pid.trim()])
                .stderr(Stdio::null())
                .status();
        }
    }
}
