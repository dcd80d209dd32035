//! `api-server`: `serve`, `migrate`, and `users create`. Configuration comes from the
//! environment (see the README); this file only parses the command line and wires things up.

use anyhow::Context;
use api_server::{App, auth, config::Config, server};
use clap::{Parser, Subcommand};
use tracing_subscriber::{EnvFilter, fmt, prelude::*};

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
    init_logging();
    let cli = Cli::parse();
    let config = Config::from_env().context("invalid configuration")?;
    match cli.command {
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
            let app = App::from_config(&config).context("cannot build the service")?;
            let listener = tokio::net::TcpListener::bind(config.grpc_listen_addr)
                .await
                .with_context(|| format!("cannot listen on {}", config.grpc_listen_addr))?;
            tracing::info!(addr = %listener.local_addr()?, "api-server listening");
            server::serve(listener, app, shutdown_signal())
                .await
                .context("server failed")?;
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

fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|format| format == "json");
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        registry
            .with(fmt::layer().json().with_writer(std::io::stderr))
            .init();
    } else {
        registry
            .with(fmt::layer().with_writer(std::io::stderr))
            .init();
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
