//! Everything decided and prepared before the first child starts: the run's id, seed and
//! directories ([`Plan`]), its private PostgreSQL and RabbitMQ, the addresses and environment
//! every child is started with ([`Wiring`]), and a fresh database. A run names everything it
//! creates after its id, so that runs never share state and a failed one can be found again.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use diesel_async::RunQueryDsl;
use rand::Rng;
use tokio::process::Command;

use workers::testing::{NodeTls, RabbitNode};

use crate::{
    args::Args,
    processes::port_in_use,
    services::{self, Services},
};

pub(crate) const STRIPE_KEY: &str = "sk_test_proof_campaign";
/// The api-servers' settings the campaign sets away from their production defaults, left unset
/// with `--production-defaults` (as are the lifted limits, `api_server::limits::LIFTED`).
const CAMPAIGN_API_SETTINGS: [&str; 4] = [
    "DATABASE_POOL_SIZE",
    "DATABASE_POOL_TIMEOUT_MS",
    "STRIPE_TIMEOUT_MS",
    "IDEMPOTENCY_LOCK_TIMEOUT_SECS",
];

/// What the run is and where it writes, decided before anything starts.
pub(crate) struct Plan {
    pub(crate) started: Instant,
    pub(crate) seed: u64,
    pub(crate) run_id: String,
    /// Of traffic and faults.
    pub(crate) duration: Duration,
    pub(crate) bin_dir: PathBuf,
    pub(crate) out_dir: PathBuf,
    pub(crate) mail_dir: PathBuf,
    pub(crate) log_dir: PathBuf,
}

impl Plan {
    /// Draws the seed and the run id, and creates the output directories.
    pub(crate) fn new(args: &Args) -> anyhow::Result<Self> {
        let started = Instant::now();
        let long = args.long;
        let duration =
            Duration::from_secs(args.duration_secs.unwrap_or(if long { 600 } else { 60 }));
        let seed = args.seed.unwrap_or_else(|| rand::rng().random());
        let run_id = format!("{:08x}", rand::rng().random::<u32>());
        let bin_dir = match &args.bin_dir {
            Some(dir) => dir.clone(),
            None => std::env::current_exe()?
                .parent()
                .context("no directory of the proof binary")?
                .to_path_buf(),
        };
        let out_dir = args
            .out_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("target/proof").join(&run_id));
        let mail_dir = out_dir.join("mail");
        let log_dir = out_dir.join("logs");
        std::fs::create_dir_all(&mail_dir)?;
        std::fs::create_dir_all(&log_dir)?;
        Ok(Plan {
            started,
            seed,
            run_id,
            duration,
            bin_dir,
            out_dir,
            mail_dir,
            log_dir,
        })
    }
}

/// Fails when a fixed port is taken: every child restarted during the run must find its port
/// free, and two runs on one machine would fault each other.
pub(crate) async fn check_ports_free(args: &Args) -> anyhow::Result<()> {
    for port in [
        args.grpc_port,
        args.grpc_port_b,
        args.stripe_port,
        args.smtp_port,
        args.mail_search_port,
        args.pg_port,
        args.amqp_port,
    ]
    .into_iter()
    .chain(args.lb.then_some(args.lb_port))
    // ha.sh reuses a server it finds on its port: a stale topology must not be mistaken for the
    // run's own (its PostgreSQL ports and first broker; the layout is in ha.sh).
    .chain(if args.ha {
        vec![
            args.ha_port_base + 432,
            args.ha_port_base + 433,
            args.ha_port_base + 672,
        ]
    } else {
        Vec::new()
    }) {
        if port_in_use(port).await {
            bail!("127.0.0.1:{port} is already in use (another proof run?)");
        }
    }
    Ok(())
}

/// Private servers, so that restarting them disturbs nobody; the shared ones otherwise.
pub(crate) async fn start_services(args: &Args, plan: &Plan) -> anyhow::Result<Services> {
    let run_id = &plan.run_id;
    let services_dir = std::env::temp_dir().join(format!("rides-proof-{run_id}"));
    if args.ha {
        let ha = services::Ha::up(&services_dir.join("ha"), args.ha_port_base).await?;
        return Ok(Services {
            pg: None,
            rabbit: None,
            ha: Some(ha),
            dir: services_dir,
        });
    }
    let pg = match (args.shared_services, services::Postgres::find_binaries()) {
        (false, Some(bin)) => Some(
            services::Postgres::init_and_start(bin, &services_dir.join("pg"), args.pg_port).await?,
        ),
        (false, None) => {
            println!("proof: no PostgreSQL server binaries: using --admin-url, restarts skipped");
            None
        }
        (true, _) => None,
    };
    let rabbit = if !args.shared_services && RabbitNode::available() {
        match start_rabbit(args, &services_dir, run_id).await {
            Ok(rabbit) => Some(rabbit),
            Err(error) => {
                if let Some(pg) = &pg {
                    let _ = pg.stop_fast().await;
                }
                return Err(error);
            }
        }
    } else {
        if !args.shared_services {
            println!("proof: no RabbitMQ server binaries: using --amqp-url, restarts skipped");
        }
        None
    };
    Ok(Services {
        pg,
        rabbit,
        ha: None,
        dir: services_dir,
    })
}

/// The run's own RabbitMQ node: with `--tls-dir` its only listener speaks TLS, with the
/// api-servers' server certificate (its names are 127.0.0.1 and localhost), so every worker's
/// AMQP hop runs over `amqps://`.
async fn start_rabbit(
    args: &Args,
    services_dir: &Path,
    run_id: &str,
) -> anyhow::Result<RabbitNode> {
    let tls = args.tls_dir.as_ref().map(|dir| NodeTls {
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
        ca: dir.join("ca.pem"),
    });
    let node = RabbitNode::configure(
        &services_dir.join("rabbitmq"),
        &format!("proof-{run_id}"),
        args.amqp_port,
        args.amqp_port
            .checked_add(20_000)
            .context("--amqp-port leaves no room for Erlang distribution's port (+20000)")?,
        tls,
    )?;
    node.start().await?;
    Ok(node)
}

/// Where the children find the database, the broker, the provider, the mail relay and each
/// other: the environment every child starts with.
pub(crate) struct Wiring {
    pub(crate) admin_url: String,
    pub(crate) db_name: String,
    pub(crate) database_url: String,
    /// Of the run's RabbitMQ topology, so that its queues are its own.
    pub(crate) prefix: String,
    pub(crate) grpc_addr: String,
    pub(crate) stripe_base: String,
    pub(crate) env: Vec<(String, String)>,
}

impl Wiring {
    pub(crate) fn new(args: &Args, plan: &Plan, services: &Services) -> anyhow::Result<Self> {
        let run_id = &plan.run_id;
        let (admin_url, amqp_url) = match (&services.ha, &services.pg, &services.rabbit) {
            (Some(ha), _, _) => (ha.admin_url.clone(), ha.amqp_url.clone()),
            (None, pg, rabbit) => (
                pg.as_ref()
                    .map_or_else(|| args.admin_url.clone(), services::Postgres::admin_url),
                rabbit
                    .as_ref()
                    .map_or_else(|| args.amqp_url.clone(), RabbitNode::url),
            ),
        };
        let db_name = format!("proof_{run_id}");
        let database_url = schema::database_url(&admin_url, &db_name);
        let prefix = format!("proof-{run_id}");
        let internal_token = format!("proof-internal-{}", uuid::Uuid::new_v4().simple());
        let grpc_addr = format!("127.0.0.1:{}", args.grpc_port);
        let stripe_base = format!("http://127.0.0.1:{}", args.stripe_port);
        let smtp_addr = format!("127.0.0.1:{}", args.smtp_port);
        let mail_search_url = format!("http://127.0.0.1:{}", args.mail_search_port);
        let lock_timeout = args.lock_timeout_secs().to_string();
        let lifted = if args.production_defaults {
            &[][..]
        } else {
            api_server::limits::LIFTED
        };
        let mut env: Vec<(String, String)> = [
            ("DATABASE_URL", database_url.as_str()),
            ("DATABASE_POOL_SIZE", "8"),
            ("DATABASE_POOL_TIMEOUT_MS", "2000"),
            ("GRPC_LISTEN_ADDR", grpc_addr.as_str()),
            ("STRIPE_API_BASE", stripe_base.as_str()),
            ("STRIPE_SECRET_KEY", STRIPE_KEY),
            ("STRIPE_TIMEOUT_MS", "2000"),
            ("IDEMPOTENCY_LOCK_TIMEOUT_SECS", lock_timeout.as_str()),
            ("INTERNAL_API_TOKEN", internal_token.as_str()),
            ("METRICS_LISTEN_ADDR", "off"),
            ("RUST_LOG", "info"),
            ("AMQP_URL", amqp_url.as_str()),
            ("AMQP_TOPOLOGY_PREFIX", prefix.as_str()),
            ("SMTP_URL", &smtp_url(args, &smtp_addr)),
            ("SMTP_TIMEOUT_SECS", "2"),
            ("RECEIPTS_CLAIM_LEASE_SECS", "5"),
            ("MAIL_SEARCH_URL", mail_search_url.as_str()),
            ("RECEIPTS_RETRY_BASE_MS", "200"),
            ("RECEIPTS_RETRY_MAX_MS", "2000"),
            ("ENQUEUER_IDLE_MAX_MS", "500"),
            ("ENQUEUER_CONFIRM_TIMEOUT_MS", "5000"),
            ("COMPLETER_MIN_AGE_SECS", "3"),
            ("COMPLETER_IDLE_SECS", "2"),
            ("COMPLETER_BACKOFF_BASE_SECS", "1"),
            ("COMPLETER_BACKOFF_MAX_SECS", "4"),
            ("COMPLETER_MAX_ATTEMPTS", "20"),
            ("COMPLETER_LEASE_SECS", "30"),
            ("COMPLETER_RPC_TIMEOUT_SECS", "15"),
            ("COMPLETER_BATCH_SIZE", "200"),
        ]
        .iter()
        // The campaign's clients run closed loops to prove exactly-once under crashes, not the
        // per-user limits: lifted, unless the run measures the production defaults.
        .chain(lifted)
        .filter(|(k, _)| !(args.production_defaults && CAMPAIGN_API_SETTINGS.contains(k)))
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        env.extend(tls_env(args, &grpc_addr));
        if args.money {
            env.push((
                "COMPLETER_MAX_ATTEMPTS".into(),
                crate::money::COMPLETER_MAX_ATTEMPTS.into(),
            ));
        }
        Ok(Wiring {
            admin_url,
            db_name,
            database_url,
            prefix,
            grpc_addr,
            stripe_base,
            env,
        })
    }
}

/// The mail sink's URL: with `--tls-dir`, STARTTLS required and verified against the run's CA.
fn smtp_url(args: &Args, smtp_addr: &str) -> String {
    match &args.tls_dir {
        None => format!("smtp://{smtp_addr}"),
        Some(dir) => format!(
            "smtp://{smtp_addr}?tls=required&cacertfile={}",
            dir.join("ca.pem").display()
        ),
    }
}

/// The environment that puts every gRPC hop over mutual TLS (`--tls-dir`): the api-servers'
/// certificates and client CA, and the completer's URL, CA and client certificate.
fn tls_env(args: &Args, grpc_addr: &str) -> Vec<(String, String)> {
    let Some(dir) = &args.tls_dir else {
        return vec![("API_SERVER_URL".into(), format!("http://{grpc_addr}"))];
    };
    let file = |name: &str| dir.join(name).display().to_string();
    vec![
        ("API_SERVER_URL".into(), format!("https://{grpc_addr}")),
        ("GRPC_TLS_CERT".into(), file("server.pem")),
        ("GRPC_TLS_KEY".into(), file("server.key")),
        ("GRPC_TLS_CLIENT_CA".into(), file("ca.pem")),
        ("API_SERVER_CA".into(), file("ca.pem")),
        ("API_SERVER_CLIENT_CERT".into(), file("client.pem")),
        ("API_SERVER_CLIENT_KEY".into(), file("client.key")),
    ]
}

/// The binary `name` the campaign starts with: with `--rolling-from`, the older build's when
/// that directory has one (every rollout then starts this build's), else this build's.
pub(crate) fn first_binary(args: &Args, plan: &Plan, name: &str) -> PathBuf {
    args.rolling_from
        .as_ref()
        .map(|dir| dir.join(name))
        .filter(|bin| bin.exists())
        .unwrap_or_else(|| plan.bin_dir.join(name))
}

/// `api-server migrate` with the given binary: on a fresh database it creates the schema; on one
/// an older build migrated, it applies this build's migrations.
pub(crate) async fn migrate(api_server: &Path, env: &[(String, String)]) -> anyhow::Result<()> {
    let migrate = Command::new(api_server)
        .arg("migrate")
        .envs(env.iter().cloned())
        .kill_on_drop(true)
        .output()
        .await
        .context("running api-server migrate")?;
    if !migrate.status.success() {
        bail!(
            "api-server migrate failed: {}",
            String::from_utf8_lossy(&migrate.stderr)
        );
    }
    Ok(())
}

/// Drops the run's database and deletes its queues, unless `--keep`. Only for a run on the
/// shared servers: private ones are deleted whole.
pub(crate) struct DbGuard {
    admin_url: String,
    name: String,
    keep: bool,
    prefix: String,
}

impl DbGuard {
    pub(crate) fn new(wiring: &Wiring, keep: bool) -> Self {
        DbGuard {
            admin_url: wiring.admin_url.clone(),
            name: wiring.db_name.clone(),
            keep,
            prefix: wiring.prefix.clone(),
        }
    }

    pub(crate) async fn cleanup(&self) {
        if self.keep {
            println!("proof: kept database {} (--keep)", self.name);
            return;
        }
        match schema::connect(&self.admin_url).await {
            Ok(mut admin) => {
                if let Err(e) = diesel::sql_query(format!(
                    "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                    self.name
                ))
                .execute(&mut admin)
                .await
                {
                    eprintln!("proof: cannot drop database {}: {e}", self.name);
                }
            }
            Err(e) => eprintln!("proof: cannot connect to drop {}: {e}", self.name),
        }
        // Best effort: the run's quorum queues (exchanges are left; they hold nothing).
        for queue in ["receipts", "dead-letter"] {
            let _ = Command::new("rabbitmqctl")
                .args(["delete_queue", &format!("{}.{queue}", self.prefix)])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .status()
                .await;
        }
    }
}
