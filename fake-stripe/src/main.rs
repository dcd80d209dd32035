//! `fake-stripe` binary: runs the fake Stripe PaymentIntents API for local development.
//!
//! Point the api-server's Stripe base URL at the printed address. Logs go to stderr, one
//! line per request; the API key, payment-method ids and idempotency keys are never logged.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use fake_stripe::{Config, serve};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "fake-stripe",
    version,
    about = "A fake Stripe PaymentIntents API for tests and local development"
)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "FAKE_STRIPE_LISTEN", default_value = "127.0.0.1:12111")]
    listen: SocketAddr,
    /// The only secret key accepted; when unset any `sk_test_...` key is accepted.
    #[arg(long, env = "FAKE_STRIPE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// How long idempotency keys are remembered, from first use.
    #[arg(long, default_value_t = 86_400)]
    idempotency_window_secs: u64,
    /// Simulated provider latency added to each executed charge.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Extra latency of a call hit by the `slow` fault (`POST /_faults {"mode":"slow"}`).
    #[arg(long, default_value_t = 8_000)]
    slow_fault_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let config = Config {
        api_key: args.api_key,
        idempotency_window: Duration::from_secs(args.idempotency_window_secs),
        latency: Duration::from_millis(args.latency_ms),
        slow_fault_delay: Duration::from_millis(args.slow_fault_ms),
        ..Config::default()
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    println!("fake-stripe listening on http://{addr}");
    serve(listener, config, shutdown_signal()).await;
    tracing::info!("fake-stripe stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM. If a handler cannot be installed, that signal is simply
/// not awaited (the process can still be killed) rather than shutting down at once.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutdown signal received");
}
