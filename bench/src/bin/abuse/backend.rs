//! The legitimate backend: a rider-facing service that carries many riders' tokens
//! over one HTTP/2 connection from one address, the caller this service exists for. Each of its
//! runs gets riders of its own, created just before it, so every rider is cold (the api-server
//! has never seen the token) and calls once: the worst case after a restart, a rollout or a
//! scale-out. 64 calls in flight, no client retry: a refusal is a failed rider.
//!
//! It runs from its own address ([`BACKEND_ADDR`]) so that attacks can come from that address
//! too (the proxy case) or from another one.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Instant,
};

use anyhow::Context;
use bench::latency::{Latencies, Percentiles};
use futures_util::{StreamExt, TryStreamExt};
use serde::Serialize;

use crate::{
    attacks::Tally,
    traffic::{PARAMS, authorized, connected_client, label},
};

/// The backend's address; attacks "from the backend's own address" bind to it too.
pub const BACKEND_ADDR: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// Another single address, for the same attacks from elsewhere.
pub const OTHER_ADDR: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
/// Cold riders created for each run.
pub const RIDERS: usize = 10_000;
/// Calls in flight, all on one connection.
pub const IN_FLIGHT: usize = 64;
/// The mail domain of backend riders: the campaign's row counts treat them as legitimate.
pub const RIDER_DOMAIN: &str = "backend.rocketrides.test";

/// The backend's goals, against the same backend on a server with every defence lifted: the
/// defences may cost the caller this service exists for little throughput and latency.
pub const THROUGHPUT_GOAL: f64 = 0.9;
pub const P99_GOAL: f64 = 1.5;

/// What one backend run saw.
#[derive(Debug, Default, Serialize)]
pub struct BackendRun {
    pub secs: f64,
    /// Calls made (each with a rider of its own, none retried).
    pub calls: u64,
    pub ok: u64,
    pub ok_per_s: f64,
    /// OK calls' latency.
    pub latency: Percentiles,
    /// Non-OK answers by code/reason.
    pub refused: Tally,
}

impl BackendRun {
    /// The reference the goals are judged against: the mean throughput and p99 of the runs with
    /// every defence lifted (one before the campaign, one after it, on a machine whose load
    /// drifts); none without a reference run.
    pub fn mean(runs: &[BackendRun]) -> Option<BackendRun> {
        if runs.is_empty() {
            return None;
        }
        let n = runs.len() as f64;
        let mean = |f: fn(&BackendRun) -> f64| runs.iter().map(f).sum::<f64>() / n;
        Some(BackendRun {
            ok_per_s: mean(|r| r.ok_per_s),
            latency: Percentiles {
                p50_ms: mean(|r| r.latency.p50_ms),
                p99_ms: mean(|r| r.latency.p99_ms),
                ..Percentiles::default()
            },
            ..BackendRun::default()
        })
    }

    /// The goals this run missed against `reference` (none: met).
    pub fn misses(&self, reference: &BackendRun) -> Vec<String> {
        let mut misses = Vec::new();
        let failed = self.calls - self.ok;
        if failed > 0 {
            misses.push(format!(
                "backend: {failed} of {} calls not OK {:?}",
                self.calls, self.refused
            ));
        }
        if self.ok_per_s < THROUGHPUT_GOAL * reference.ok_per_s {
            misses.push(format!(
                "backend throughput {:.1}/s < {THROUGHPUT_GOAL} × {:.1}/s",
                self.ok_per_s, reference.ok_per_s
            ));
        }
        if self.latency.p99_ms > P99_GOAL * reference.latency.p99_ms {
            misses.push(format!(
                "backend p99 {:.0} ms > {P99_GOAL} × {:.0} ms",
                self.latency.p99_ms, reference.latency.p99_ms
            ));
        }
        misses
    }

    /// `calls ok/s p50/p99 (×ref) non-OK` for the table.
    pub fn cells(&self, reference: Option<&BackendRun>) -> String {
        let ratio = |now: f64, then: f64| {
            if then > 0.0 {
                format!(" ({:.2}×)", now / then)
            } else {
                String::new()
            }
        };
        let (throughput, p99) = match reference {
            Some(r) => (
                ratio(self.ok_per_s, r.ok_per_s),
                ratio(self.latency.p99_ms, r.latency.p99_ms),
            ),
            None => (String::new(), String::new()),
        };
        format!(
            "{} / {} | {:.1}{throughput} | {:.0} / {:.0}{p99} | {}",
            self.ok,
            self.calls,
            self.ok_per_s,
            self.latency.p50_ms,
            self.latency.p99_ms,
            self.calls - self.ok,
        )
    }
}

/// The riders of one run: `RIDERS` new users (one INSERT each, 8 at a time), cold on any server.
pub async fn riders(pool: &schema::Pool, run: &str, batch: &str) -> anyhow::Result<Vec<String>> {
    let started = Instant::now();
    let tokens: Vec<String> = futures_util::stream::iter(0..RIDERS)
        .map(|i| async move {
            let (_, token) = api_server::auth::create_user(
                pool,
                &format!("rider-{run}-{batch}-{i}@{RIDER_DOMAIN}"),
                &format!("cus_backend_{run}_{batch}_{i}"),
                "pm_card_visa",
            )
            .await
            .with_context(|| format!("creating backend rider {i}"))?;
            anyhow::Ok(token)
        })
        .buffer_unordered(8)
        .try_collect()
        .await?;
    println!(
        "abuse: {RIDERS} cold riders for the backend ({batch}) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(tokens)
}

/// A backend run of `secs` against `target` (the reference api-server with every defence
/// lifted), with riders of its own.
pub async fn reference_run(
    pool: &schema::Pool,
    run: &str,
    batch: &str,
    target: SocketAddr,
    secs: std::time::Duration,
) -> anyhow::Result<BackendRun> {
    let running = start(target, riders(pool, run, batch).await?).await?;
    tokio::time::sleep(secs).await;
    let seen = running.finish().await?;
    println!(
        "abuse: backend ({batch}), every defence lifted: {}",
        seen.cells(None)
    );
    Ok(seen)
}

/// A backend run in progress, on a thread and runtime of its own (at normal priority, like the
/// legitimate clients: on the attackers' runtime it would queue behind their tasks).
pub struct Running {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<BackendRun>,
}

impl Running {
    /// Stops the backend (calls in flight finish) and returns what it saw.
    pub async fn finish(self) -> anyhow::Result<BackendRun> {
        self.stop.store(true, Ordering::SeqCst);
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join())
            .await?
            .map_err(|_| anyhow::anyhow!("the backend thread panicked"))
    }
}

/// Starts the backend against `target`: each call takes the next rider, until the riders run
/// out or [`Running::finish`]. Returns once its connection is open, so that an attack started
/// next meets a backend already connected, as a real one is.
pub async fn start(target: SocketAddr, riders: Vec<String>) -> anyhow::Result<Running> {
    let stop = Arc::new(AtomicBool::new(false));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (connected, is_connected) = tokio::sync::oneshot::channel();
    let flag = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("backend".into())
        .spawn(move || {
            // Threads inherit their creator's nice value; the backend is not an attacker.
            let _ = rustix::process::setpriority_process(None, 0);
            runtime.block_on(async move {
                match connected_client(target, Some(IpAddr::V4(BACKEND_ADDR))).await {
                    Ok(rpc) => {
                        let _ = connected.send(Ok(()));
                        run(rpc, riders, flag).await
                    }
                    Err(error) => {
                        let _ = connected.send(Err(error));
                        BackendRun::default()
                    }
                }
            })
        })?;
    is_connected.await??;
    Ok(Running { stop, thread })
}

async fn run(
    rpc: proto::v1::ride_service_client::RideServiceClient<tonic::transport::Channel>,
    riders: Vec<String>,
    stop: Arc<AtomicBool>,
) -> BackendRun {
    let riders = Arc::new(riders);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (mut rpc, riders, next, stop) = (
                rpc.clone(),
                Arc::clone(&riders),
                Arc::clone(&next),
                Arc::clone(&stop),
            );
            tokio::spawn(async move {
                let (mut latencies, mut refused, mut calls) =
                    (Latencies::default(), Tally::new(), 0);
                while !stop.load(Ordering::SeqCst) {
                    let Some(token) = riders.get(next.fetch_add(1, Ordering::SeqCst)) else {
                        break;
                    };
                    calls += 1;
                    let called = Instant::now();
                    match rpc.create_ride(authorized(PARAMS, token, true)).await {
                        Ok(_) => latencies.record(called.elapsed()),
                        Err(status) => crate::attacks::add(&mut refused, label(&status)),
                    }
                }
                (latencies, refused, calls)
            })
        })
        .collect();
    let mut seen = BackendRun::default();
    let mut latencies = Latencies::default();
    let mut tallies = Vec::new();
    for worker in futures_util::future::join_all(workers).await {
        let Ok((worker_latencies, refused, calls)) = worker else {
            continue;
        };
        latencies.merge(&worker_latencies);
        tallies.push(refused);
        seen.calls += calls;
    }
    seen.secs = started.elapsed().as_secs_f64();
    seen.refused = crate::attacks::merge(tallies);
    seen.latency = latencies.percentiles();
    seen.ok = seen.latency.count;
    seen.ok_per_s = seen.ok as f64 / seen.secs.max(1e-9);
    seen
}
