//! `mail-sink` binary: the development SMTP server, until SIGTERM/SIGINT. Every mail is stored as
//! an .eml file in `--dir`; with `--http-listen` it also answers the receipt worker's message
//! search (`MAIL_SEARCH_URL`). With `--tls-cert` and `--tls-key` it offers STARTTLS and AUTH
//! PLAIN (over TLS only), and with `--smtps-listen` also listens for TLS from the first byte. Logs
//! go to stderr, through the `telemetry` crate as the fleet's do.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use mail_sink::{MailSink, Retention, SinkTls};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "mail-sink",
    about = "A development SMTP server that stores every mail as an .eml file. It keeps at most \
             --max-mails mails and --max-bytes bytes of them in memory (for its search), dropping \
             the oldest first; the .eml files stay."
)]
struct Args {
    /// SMTP address to listen on.
    #[arg(long, default_value = "127.0.0.1:2525")]
    listen: SocketAddr,
    /// Where each mail is stored as an .eml file (created if missing); mails stored there by an
    /// earlier run are loaded at start.
    #[arg(long)]
    dir: PathBuf,
    /// Most mails kept in memory; the oldest are dropped first.
    #[arg(long, default_value_t = Retention::default().max_mails)]
    max_mails: usize,
    /// Most bytes of mail kept in memory; the oldest mails are dropped first.
    #[arg(long, default_value_t = Retention::default().max_bytes)]
    max_bytes: usize,
    /// Also serve the message search (Mailpit's `/api/v1/search`) here, for MAIL_SEARCH_URL.
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// The server certificate chain (PEM): STARTTLS is offered on --listen.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Also listen here for SMTP over TLS from the first byte (`smtps://`, port 465 in
    /// production); needs --tls-cert.
    #[arg(long, requires = "tls_cert")]
    smtps_listen: Option<SocketAddr>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The service name the former `workers mail-sink` subcommand reported. Like it, the sink
    // serves no /metrics.
    let telemetry =
        telemetry::Telemetry::init("rides-mail-sink").context("cannot set up telemetry")?;
    let shutdown = on_signals().context("cannot install signal handlers")?;
    let result = run(args, shutdown).await;
    telemetry.shutdown();
    result
}

async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    let retention = Retention {
        max_mails: args.max_mails,
        max_bytes: args.max_bytes,
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            SinkTls::from_pem_files(cert, key)
                .with_context(|| format!("cannot use {} and {}", cert.display(), key.display()))?,
        ),
        _ => None,
    };
    let starttls = tls.is_some();
    let sink = MailSink::spawn_with_tls(args.listen, Some(args.dir), retention, tls).await?;
    tracing::info!(addr = %sink.addr(), starttls, "mail sink listening");
    if let Some(smtps_listen) = args.smtps_listen {
        let url = sink.serve_smtps(smtps_listen).await?;
        tracing::info!(%url, "mail sink smtps listening");
    }
    if let Some(http_listen) = args.http_listen {
        let url = sink.serve_search(http_listen).await?;
        tracing::info!(%url, "mail sink search listening");
    }
    sink.run_until(shutdown).await;
    Ok(())
}

/// A token cancelled on the first SIGTERM or SIGINT: what the fleet's `workers::shutdown` does,
/// kept here so that a development tool does not depend on the production fleet.
fn on_signals() -> std::io::Result<CancellationToken> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let received = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        tracing::info!("{received} received, shutting down");
        cancel.cancel();
    });
    Ok(token)
}
