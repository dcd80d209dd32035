//! `workers`: one binary for the whole fleet. Each subcommand runs a long-lived loop until
//! SIGTERM/SIGINT, or one pass with `--once`, which prints a one-line JSON summary of counts to
//! stdout and exits 0 (non-zero on failure). Logs go to stderr.

use std::{net::SocketAddr, time::Duration};

use anyhow::Context;
use clap::{Parser, Subcommand};
use workers::{
    amqp::AmqpSession, completer::Completer, config::Config, enqueuer::Enqueuer, mailer::Mailer,
    reaper::Reaper, receipts::ReceiptWorker, reconciler::Reconciler, relay_search::RelaySearch,
    shutdown, topology::Topology,
};

#[derive(Parser)]
#[command(name = "workers", about = "Rocket Rides worker fleet")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Moves committed staged jobs to RabbitMQ.
    Enqueuer(Once),
    /// Mails ride receipts from the receipts queue.
    Receipts(Once),
    /// Pushes abandoned idempotency keys to completion through the API.
    Completer(Once),
    /// Deletes expired idempotency keys, recording unfinished ones for a human.
    Reaper(Once),
    /// Compares the provider's charges with the rides and records every mismatch.
    Reconciler(ReconcilerArgs),
    /// Operator commands: inspect and repair keys, dead letters, backlog (docs/operations.md).
    Admin(workers::admin::AdminArgs),
}

#[derive(clap::Args)]
struct Once {
    /// Run a single pass, print its JSON summary and exit.
    #[arg(long)]
    once: bool,
}

#[derive(clap::Args)]
struct ReconcilerArgs {
    #[command(flatten)]
    once: Once,
    /// Also refund the charges of open unrecorded_charge findings, each proven ours again under
    /// locks, up to RECONCILER_REFUND_MAX_FINDINGS and RECONCILER_REFUND_MAX_AMOUNT per pass
    /// (docs/money-safety.md). Never done without this flag.
    #[arg(long)]
    refund: bool,
}

impl Command {
    /// The service name this process reports, and its default Prometheus port: one per worker so
    /// that the whole fleet can run on one machine.
    fn identity(&self) -> (&'static str, u16) {
        match self {
            Command::Enqueuer(_) => ("rides-enqueuer", 9465),
            Command::Receipts(_) => ("rides-receipts", 9466),
            Command::Completer(_) => ("rides-completer", 9467),
            Command::Reaper(_) => ("rides-reaper", 9468),
            Command::Reconciler(_) => ("rides-reconciler", 9469),
            Command::Admin(_) => ("rides-admin", 9470),
        }
    }

    fn is_loop(&self) -> bool {
        match self {
            Command::Enqueuer(once)
            | Command::Receipts(once)
            | Command::Completer(once)
            | Command::Reaper(once) => !once.once,
            Command::Reconciler(args) => !args.once.once,
            Command::Admin(_) => false,
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (service_name, metrics_port) = cli.command.identity();
    let telemetry = telemetry::Telemetry::init(service_name).context("cannot set up telemetry")?;
    let shutdown = shutdown::on_signals().context("cannot install signal handlers")?;
    // A single pass (a CronJob) lives too briefly to be scraped; it pushes over OTLP if configured.
    if cli.command.is_loop()
        && let Some(addr) =
            telemetry::metrics_addr(SocketAddr::from(([127, 0, 0, 1], metrics_port)))
                .context("invalid METRICS_LISTEN_ADDR")?
    {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot serve metrics on {addr}"))?;
        let stop = shutdown.clone();
        tokio::spawn(telemetry::serve_metrics(
            listener,
            telemetry.prometheus(),
            async move { stop.cancelled().await },
        ));
    }
    let result = run(cli, shutdown).await;
    telemetry.shutdown();
    result
}

/// The database pool of a worker process.
fn database_pool(config: &Config) -> schema::Pool {
    schema::build_pool(
        config.database_url.expose(),
        config.database_pool_size,
        Duration::from_secs(30),
        schema::PlanCache::Auto,
    )
}

/// The receipt worker: one pass (`--once`, its summary) or until shutdown (`None`).
async fn receipt_worker(
    config: &Config,
    pool: schema::Pool,
    topology: Topology,
    once: bool,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<Option<serde_json::Value>> {
    let amqp_url = config.amqp_url.expose();
    let mailer = Mailer::with_connections(
        config.receipts.smtp_url.expose(),
        &config.receipts.from,
        config.receipts.smtp_timeout,
        config.receipts.smtp_connections,
    )?;
    let relay_search = config
        .receipts
        .mail_search_url
        .as_deref()
        .map(|url| RelaySearch::new(url, config.receipts.smtp_timeout))
        .transpose()?;
    let worker = ReceiptWorker::new(
        pool,
        mailer,
        relay_search,
        topology.clone(),
        config.receipts.clone(),
    );
    if !once {
        let total = worker.run(amqp_url, shutdown).await;
        tracing::info!(?total, "receipt worker stopped");
        return Ok(None);
    }
    let session = AmqpSession::open(amqp_url, &topology)
        .await
        .context("cannot reach RabbitMQ")?;
    let summary = worker.run_once(&session.channel).await;
    session.close().await;
    Ok(Some(serde_json::to_value(
        summary.context("receipts pass failed")?,
    )?))
}

async fn run(cli: Cli, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    let config = Config::from_env().context("invalid configuration")?;
    let pool = || database_pool(&config);
    let topology = Topology::from_prefix(&config.topology_prefix, config.receipt_delivery_limit);
    let amqp_url = config.amqp_url.expose();
    let summary = match cli.command {
        Command::Enqueuer(Once { once }) => {
            let mut enqueuer = Enqueuer::new(pool(), amqp_url, topology, config.enqueuer.clone());
            if once {
                // Drains until nothing is due, as a CronJob wants; SIGTERM (a deadline, a node
                // drain) still ends it after the batch in flight.
                let summary = enqueuer.run_pass(&shutdown).await;
                serde_json::to_value(summary.context("enqueuer pass failed")?)?
            } else {
                let total = enqueuer.run(shutdown).await;
                tracing::info!(?total, "enqueuer stopped");
                return Ok(());
            }
        }
        Command::Receipts(Once { once }) => {
            match receipt_worker(&config, pool(), topology, once, shutdown).await? {
                Some(summary) => summary,
                None => return Ok(()),
            }
        }
        Command::Completer(Once { once }) => {
            let completer = Completer::new(pool(), config.completer.clone())?;
            if once {
                serde_json::to_value(
                    completer
                        .run_once()
                        .await
                        .context("completer pass failed")?,
                )?
            } else {
                let total = completer.run(shutdown).await;
                tracing::info!(?total, "completer stopped");
                return Ok(());
            }
        }
        Command::Reaper(Once { once }) => {
            let reaper = Reaper::new(pool(), config.reaper.clone());
            if once {
                serde_json::to_value(reaper.run_once().await.context("reaper pass failed")?)?
            } else {
                let total = reaper.run(shutdown).await;
                tracing::info!(?total, "reaper stopped");
                return Ok(());
            }
        }
        Command::Reconciler(ReconcilerArgs {
            once: Once { once },
            refund,
        }) => {
            let reconciler = Reconciler::new(pool(), config.reconciler.clone())?;
            if once {
                serde_json::to_value(
                    reconciler
                        .run_once(refund)
                        .await
                        .context("reconciler pass failed")?,
                )?
            } else {
                let total = reconciler.run(refund, shutdown).await;
                tracing::info!(?total, "reconciler stopped");
                return Ok(());
            }
        }
        // Prints its own report (text or --json) on stdout; fails with a clear message.
        Command::Admin(args) => return workers::admin::run(args, &config, shutdown).await,
    };
    println!("{summary}");
    Ok(())
}
