//! The thread every pooled database connection's I/O runs on (a connection opened alone with
//! [`crate::connect`], such as this process's liveness session, stays on its caller's runtime).
//!
//! The api-server's batch statements are what every request waits for: one batch of each kind is
//! in flight at a time (`api_server::idempotency::batch`), and the requests that arrive meanwhile
//! wait for its answer. On the process's main runtime that answer waited behind every gRPC task
//! queued there, twice: for the tokio-postgres connection task to read it off the socket, and for
//! the batch runner to decode it and hand it out. A replay batch's claim statement took 1.0–1.4
//! ms from the runner's point of view where PostgreSQL needs about 0.5 (docs/performance.md,
//! run 29). So each pooled connection's task, and the batch runners, run on a single-threaded
//! runtime of their own, on a thread that is idle between answers: an answer is read and handed
//! out as soon as it arrives (0.6–1.0 ms in the same measurement), and the requests it wakes run
//! on the main runtime as before. Fresh rides at the production defaults gained 5–15 %; replays
//! behind the same callers lost 7–10 %, their batches smaller now that each cycle is shorter
//! (run 29's A/B, with the api-server pinned to one runtime thread; one pair at its default two
//! gave replays +10 %).
//!
//! The runtime is one per process, started on first use and never stopped (it ends with the
//! process). If its thread cannot be started, everything runs on the caller's runtime, as it did
//! before the thread existed.

use std::{future::Future, sync::OnceLock};

use tokio::{runtime::Handle, task::JoinHandle};

static IO_THREAD: OnceLock<Option<Handle>> = OnceLock::new();

/// Runs `future` on the database I/O thread (or, if that thread could not be started, on the
/// current runtime).
pub fn spawn<F>(future: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match handle() {
        Some(handle) => handle.spawn(future),
        None => tokio::spawn(future),
    }
}

fn handle() -> Option<&'static Handle> {
    IO_THREAD.get_or_init(start).as_ref()
}

/// Starts the thread and its runtime, and returns the runtime's handle. The runtime is built on
/// its own thread and only its handle comes back: a runtime dropped on the caller's (if the
/// thread could not start) would panic inside an async context.
fn start() -> Option<Handle> {
    let (handle_sender, handle_receiver) = std::sync::mpsc::channel();
    let started = std::thread::Builder::new()
        .name("database-io".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            match runtime {
                Ok(runtime) => {
                    let _ = handle_sender.send(Some(runtime.handle().clone()));
                    runtime.block_on(std::future::pending::<()>());
                }
                Err(error) => {
                    tracing::error!(%error, "cannot start the database I/O runtime");
                    let _ = handle_sender.send(None);
                }
            }
        });
    if let Err(error) = started {
        tracing::error!(%error, "cannot start the database I/O thread");
        return None;
    }
    handle_receiver.recv().ok().flatten()
}

#[cfg(test)]
mod tests {
    /// A current-thread runtime, as `#[tokio::test]` and a small process would have: the work
    /// still runs on the database I/O thread, not on the caller's.
    #[tokio::test]
    async fn spawned_work_runs_on_the_database_io_thread() {
        let name = super::spawn(async { std::thread::current().name().map(str::to_owned) })
            .await
            .expect("the task ran to its end");
        assert_eq!(name.as_deref(), Some("database-io"));
    }
}
