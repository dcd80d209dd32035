//! `--window-secs`: the traffic figures of every window of a long run (the soak,
//! `bench/soak.sh`), each appended to `--windows-out` as one JSON line when its window closes, so
//! a run of an hour shows whether latency and errors drift while it runs, not only at its end.
//!
//! Every logical request of the measured run is recorded in the window its final answer falls
//! in: its latency, and each of its attempts' `CODE/REASON` labels (the same labels the run's
//! summary counts).

use std::{
    collections::BTreeMap,
    fs::OpenOptions,
    io::Write,
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use bench::latency::Latencies;
use serde_json::json;
use tokio::task::JoinHandle;

/// What the open window has seen so far.
#[derive(Default)]
struct Window {
    latencies: Latencies,
    attempts: BTreeMap<String, u64>,
    ok: u64,
    failed: u64,
}

pub(crate) struct Windows {
    open: Mutex<Window>,
    length: Duration,
    out: PathBuf,
}

fn locked(mutex: &Mutex<Window>) -> MutexGuard<'_, Window> {
    // Counters only, valid at every step: a panicked client cannot leave them torn.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn unix_secs(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64())
}

impl Windows {
    pub(crate) fn new(length: Duration, out: PathBuf) -> Windows {
        Windows {
            open: Mutex::new(Window::default()),
            length,
            out,
        }
    }

    /// One logical request's final answer, its latency and its attempts' labels.
    pub(crate) fn record<'a>(
        &self,
        latency: Duration,
        labels: impl IntoIterator<Item = &'a str>,
        ok: bool,
    ) {
        let mut window = locked(&self.open);
        window.latencies.record(latency);
        for label in labels {
            *window.attempts.entry(label.to_owned()).or_default() += 1;
        }
        if ok {
            window.ok += 1;
        } else {
            window.failed += 1;
        }
    }

    /// Closes a window every `--window-secs` from `measure_from` until `deadline`, then the
    /// last (shorter) one, if any request fell in it.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        measure_from: Instant,
        deadline: Option<Instant>,
    ) -> JoinHandle<anyhow::Result<()>> {
        let windows = Arc::clone(self);
        tokio::spawn(async move {
            let mut opened = measure_from;
            for index in 1_u64.. {
                let closes = opened + windows.length;
                let last = deadline.is_some_and(|deadline| closes >= deadline);
                let closes = match deadline {
                    Some(deadline) if last => deadline,
                    _ => closes,
                };
                tokio::time::sleep_until(closes.into()).await;
                windows.close(index, opened, closes, last)?;
                if last {
                    break;
                }
                opened = closes;
            }
            Ok(())
        })
    }

    fn close(
        &self,
        index: u64,
        opened: Instant,
        closed: Instant,
        last: bool,
    ) -> anyhow::Result<()> {
        let window = std::mem::take(&mut *locked(&self.open));
        let secs = closed.saturating_duration_since(opened).as_secs_f64();
        let now = SystemTime::now();
        let closed_at = unix_secs(now);
        let p = window.latencies.percentiles();
        let line = json!({
            "window": index,
            "start_unix": closed_at - secs,
            "end_unix": closed_at,
            "secs": secs,
            "full": (secs - self.length.as_secs_f64()).abs() < 1.0,
            "last": last,
            "ok": window.ok,
            "failed": window.failed,
            "rides_per_s": window.ok as f64 / secs.max(1e-9),
            "latency_ms": p,
            "attempts": window.attempts,
        });
        eprintln!(
            "window {index}: {:.1} rides/s, p50 {:.1} ms, p99 {:.1} ms, {} failed",
            window.ok as f64 / secs.max(1e-9),
            p.p50_ms,
            p.p99_ms,
            window.failed
        );
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.out)?;
        writeln!(file, "{line}")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_window_writes_its_answers_and_the_next_starts_empty() {
        let out = std::env::temp_dir().join(format!(
            "loadgen-windows-{}-{}.jsonl",
            std::process::id(),
            unix_secs(SystemTime::now())
        ));
        let windows = Windows::new(Duration::from_secs(10), out.clone());
        let opened = Instant::now();
        windows.record(Duration::from_millis(250), ["OK"], true);
        windows.record(
            Duration::from_millis(900),
            ["Unavailable/PAYMENT_PROVIDER_UNAVAILABLE", "OK"],
            true,
        );
        windows.record(Duration::from_millis(40), ["ResourceExhausted/-"], false);
        windows
            .close(1, opened, opened + Duration::from_secs(10), false)
            .unwrap();
        windows
            .close(
                2,
                opened + Duration::from_secs(10),
                opened + Duration::from_secs(14),
                true,
            )
            .unwrap();

        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        let first = &lines[0];
        assert_eq!(first["window"], 1);
        assert_eq!(first["full"], true);
        assert_eq!(first["ok"], 2);
        assert_eq!(first["failed"], 1);
        assert_eq!(first["rides_per_s"], 0.2);
        assert_eq!(first["attempts"]["OK"], 2);
        assert_eq!(
            first["attempts"]["Unavailable/PAYMENT_PROVIDER_UNAVAILABLE"],
            1
        );
        assert_eq!(first["latency_ms"]["count"], 3);
        let second = &lines[1];
        assert_eq!(second["full"], false);
        assert_eq!(second["last"], true);
        assert_eq!(second["ok"], 0);
        assert_eq!(second["latency_ms"]["count"], 0);
        std::fs::remove_file(&out).unwrap();
    }
}
