//! `api-server`: `serve`, `migrate`, `health-check` and `users create`. Configuration comes from the
//! environment (see docs/configuration.md); this file only parses the command line and wires things up.

use anyhow::Context;
use api_server::{App, auth, config::Config, health_check, server};
use clap::{Parser, Subcommand};

/// Every request allocates and frees a few hundred small objects (HTTP/2 frames, protobuf
/// messages, span data, rows) across tasks: glibc's malloc and free were 13 % of the api-server's
/// CPU at 500 clients, and mimalloc cut its CPU per request by 13–20 % (25 % per replay) for
/// about 20 MB more RSS, measured A/B on the same machine and load (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(version, about = "Rocket Rides payments API server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the gRPC API on GRPC_LISTEN_ADDR until SIGTERM or SIGINT.
    Serve,
    /// Apply pending database migrations.
    Migrate,
    /// Ask this configuration's own listener (on loopback, over TLS when GRPC_TLS_* is set) whether
    /// a service is SERVING: the container's probe. Exits 0 only when it is.
    HealthCheck {
        /// The grpc.health.v1 service: `liveness`, `rides.v1.RideService`, or "" for the server.
        #[arg(long, default_value = "")]
        service: String,
        /// The CA the listener's certificate is verified against (default: GRPC_TLS_CLIENT_CA).
        #[arg(long)]
        ca: Option<std::path::PathBuf>,
    },
    /// Manage users.
    Users {
        #[command(subcommand)]
        command: UsersCommand,
    },
}

#[derive(Subcommand)]
enum UsersCommand {
    /// Create a user and print its API token as the last line of stdout.
    Create {
        #[arg(long)]
        email: String,
        #[arg(long)]
        stripe_customer_id: String,
        #[arg(long)]
        stripe_payment_method_id: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // A probe runs every few seconds: no telemetry set-up, no log lines, just the exit code and a
    // reason on failure.
    if let Command::HealthCheck { service, ca } = &cli.command {
        let config = Config::from_env().context("invalid configuration")?;
        health_check::check(&config, service, ca.as_deref())
            .await
            .context("health check failed")?;
        return Ok(());
    }
    let telemetry =
        telemetry::Telemetry::init("rides-api-server").context("cannot set up telemetry")?;
    let result = run(cli, &telemetry).await;
    telemetry.shutdown();
    result
}

async fn run(cli: Cli, telemetry: &telemetry::Telemetry) -> anyhow::Result<()> {
    let config = Config::from_env().context("invalid configuration")?;
    match cli.command {
        // Answered in `main`, before telemetry.
        Command::HealthCheck { .. } => {}
        Command::Migrate => {
            if schema::migrations::create_database_if_missing(config.database.url.expose())
                .await
                .context("cannot create the database")?
            {
                println!("created the database");
            }
            let applied = schema::migrations::run_pending(config.database.url.expose())
                .await
                .context("migration failed")?;
            if applied.is_empty() {
                println!("database is up to date");
            }
            for version in applied {
                println!("applied {version}");
            }
        }
        Command::Serve => {
            raise_open_file_limit();
            let app = App::from_config(&config).context("cannot build the service")?;
            let listener = tokio::net::TcpListener::bind(config.grpc_listen_addr)
                .await
                .with_context(|| format!("cannot listen on {}", config.grpc_listen_addr))?;
            tracing::info!(addr = %listener.local_addr()?, "api-server listening");
            let (stop_metrics, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
            if let Some(addr) =
                telemetry::metrics_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 9464)))
                    .context("invalid METRICS_LISTEN_ADDR")?
            {
                let metrics_listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot serve metrics on {addr}"))?;
                tokio::spawn(telemetry::serve_metrics(
                    metrics_listener,
                    telemetry.prometheus(),
                    async move {
                        let _ = metrics_stopped.await;
                    },
                ));
            }
            server::serve(listener, app, shutdown_signal())
                .await
                .context("server failed")?;
            let _ = stop_metrics.send(());
            tracing::info!("api-server stopped");
        }
        Command::Users {
            command:
                UsersCommand::Create {
                    email,
                    stripe_customer_id,
                    stripe_payment_method_id,
                },
        } => {
            let app = App::from_config(&config).context("cannot build the service")?;
            let (user, token) = auth::create_user(
                app.rides.pool(),
                &email,
                &stripe_customer_id,
                &stripe_payment_method_id,
            )
            .await
            .context("cannot create the user")?;
            println!("created user {} <{}>", user.id, user.email);
            println!("{token}");
        }
    }
    Ok(())
}

/// Raises the soft limit on open files to the hard limit: every connection is a descriptor, and
/// a pod cannot set its limits (Kubernetes has no rlimit field), while container runtimes leave
/// a low soft limit under a high hard one. The limits in force are logged.
fn raise_open_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let raised = rustix::process::Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => {
            tracing::info!(open_files = ?limit.maximum, "open-file limit raised to the hard limit")
        }
        Err(error) => {
            tracing::warn!(%error, soft = ?limit.current, hard = ?limit.maximum, "cannot raise the open-file limit");
        }
    }
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}
