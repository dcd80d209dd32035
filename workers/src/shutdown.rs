//! Turns SIGTERM and SIGINT into a [`CancellationToken`]. Loops take the token explicitly, so
//! tests can stop them without signals (the loop itself: [`crate::worker_loop`]).

use tokio_util::sync::CancellationToken;

/// Returns a token cancelled on the first SIGTERM or SIGINT.
pub fn on_signals() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM received, shutting down"),
            result = tokio::signal::ctrl_c() => {
                if let Err(error) = result {
                    tracing::warn!(%error, "cannot listen for SIGINT");
                    // Without SIGINT handling, SIGTERM still works: keep waiting for it.
                    terminate.recv().await;
                }
                tracing::info!("SIGINT received, shutting down");
            }
        }
        cancel.cancel();
    });
    Ok(token)
}
