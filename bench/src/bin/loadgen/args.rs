//! The command line, and the retry policy it makes.

use std::{path::PathBuf, time::Duration};

use anyhow::bail;
use clap::Parser;
use rides_client::RetryPolicy;

use crate::windows::Windows;

#[derive(Parser, Debug)]
#[command(
    name = "loadgen",
    about = "CreateRide load generator for the Rocket Rides api-server"
)]
pub(crate) struct Args {
    /// The api-server's gRPC endpoint (`https://` for TLS).
    #[arg(long, default_value = "http://127.0.0.1:25151")]
    pub(crate) target: String,
    /// CA certificate (PEM) that signed the api-server's, for an `https://` target.
    #[arg(long, env = "API_SERVER_CA")]
    pub(crate) ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for mutual TLS; needs --client-key.
    #[arg(long, env = "API_SERVER_CLIENT_CERT")]
    pub(crate) client_cert: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "API_SERVER_CLIENT_KEY")]
    pub(crate) client_key: Option<std::path::PathBuf>,
    /// The api-server's database (users are created here; the check reads it).
    #[arg(long, env = "DATABASE_URL")]
    pub(crate) database_url: String,
    /// fake-stripe's base URL, for the ledger check.
    #[arg(long, default_value = "http://127.0.0.1:12211")]
    pub(crate) stripe_base: String,
    #[arg(long, default_value = "sk_test_rocket_rides_development")]
    pub(crate) stripe_key: String,
    /// Concurrent clients (each one request at a time).
    #[arg(long, default_value_t = 8)]
    pub(crate) clients: u32,
    /// Measured duration; ignored when --requests is given. Default 10 s.
    #[arg(long)]
    pub(crate) duration_secs: Option<f64>,
    /// Total logical requests instead of a duration.
    #[arg(long)]
    pub(crate) requests: Option<u64>,
    /// Requests at the start whose latency and rate are not counted (still checked).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) warmup_secs: f64,
    /// Fraction of requests that replay a key this client already finished.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) replay_ratio: f64,
    /// Replays as first sends, without `idempotency-key-resent`: what a caller that does not say
    /// it resends a key costs (its claim sends the write statement, as before the hint).
    #[arg(long, env = "LOADGEN_REPLAYS_AS_FIRST_SENDS")]
    pub(crate) replays_as_first_sends: bool,
    /// Keys each client finishes before the measurement, as replay material.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed_keys_per_client: u32,
    /// Make the seeded keys through this endpoint instead of --target (another api-server on the
    /// same database): the measured run then replays them on an api-server that has never seen
    /// their riders' tokens, as after a restart.
    #[arg(long, requires = "seed_keys_per_client")]
    pub(crate) seed_target: Option<String>,
    /// Users to create (clients share them round-robin). Default: one per client.
    #[arg(long, conflicts_with = "riders")]
    pub(crate) users: Option<u32>,
    /// A rider pool instead of closed-loop users: this many users, and each request with a fresh
    /// key takes a random one of them. A key belongs to the rider that made it, so a replay calls
    /// as that rider: `--seed-keys-per-client` keys are made by riders taken round-robin (client
    /// c's n-th key by rider (n × clients + c) mod riders, so that the clients together cover the
    /// pool evenly), and every finished key keeps its rider.
    #[arg(long)]
    pub(crate) riders: Option<u32>,
    /// Users created at once (each is one INSERT): 10,000 riders one at a time take a while.
    #[arg(long, default_value_t = 4)]
    pub(crate) create_users_concurrency: usize,
    /// HTTP/2 connections to the server (clients share them round-robin). Default: one per 50
    /// clients, so that the server's concurrent-stream limit never throttles the clients.
    #[arg(long)]
    pub(crate) connections: Option<u32>,
    /// Attempts per logical request before it counts as failed.
    #[arg(long, default_value_t = 12)]
    pub(crate) max_attempts: u32,
    /// Deadline of one attempt.
    #[arg(long, default_value_t = 60)]
    pub(crate) request_timeout_secs: u64,
    /// Deadline of one attempt in milliseconds, instead of --request-timeout-secs: a client that
    /// gives up on an attempt after a short client-side timeout and retries with the same key.
    #[arg(long)]
    pub(crate) attempt_timeout_ms: Option<u64>,
    /// `idempotency-wait` of every attempt (`0`: do not wait for an attempt in flight with the
    /// same key, answer IDEMPOTENCY_KEY_IN_USE at once). Default: not sent, the server's maximum.
    #[arg(long)]
    pub(crate) idempotency_wait_ms: Option<u64>,
    /// Scenario name, for the report.
    #[arg(long, default_value = "adhoc")]
    pub(crate) scenario: String,
    /// The provider latency fake-stripe was started with (only recorded, for the ceiling).
    #[arg(long, default_value_t = 0)]
    pub(crate) provider_latency_ms: u64,
    /// The api-server's pid: its VmRSS is sampled and its CPU time measured.
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
    /// More processes whose CPU time is measured, as NAME=PID (e.g. fake-stripe=1234).
    #[arg(long)]
    pub(crate) cpu_pid: Vec<String>,
    /// The api-server's Prometheus endpoint (`http://…/metrics`): its batch-size histogram is
    /// read at the start and the end of the measured window for the batch fill per statement.
    #[arg(long)]
    pub(crate) metrics_url: Option<String>,
    /// Append the JSON summary as one line to this file.
    #[arg(long)]
    pub(crate) json_out: Option<PathBuf>,
    /// Skip the database and ledger check.
    #[arg(long)]
    pub(crate) no_check: bool,
    /// Also close a window of the measured run every this many seconds, and append its figures
    /// (rides/s, latency percentiles, every attempt's answer) to `--windows-out` as one JSON line.
    #[arg(long, requires = "windows_out")]
    pub(crate) window_secs: Option<u64>,
    /// Where `--window-secs` writes its lines.
    #[arg(long, requires = "window_secs")]
    pub(crate) windows_out: Option<PathBuf>,
}

impl Args {
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if self.clients == 0 {
            bail!("--clients must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.replay_ratio) {
            bail!("--replay-ratio must be within 0..=1");
        }
        if self.window_secs == Some(0) {
            bail!("--window-secs must be at least 1");
        }
        Ok(())
    }

    /// `--window-secs` and `--windows-out`, when both are given.
    pub(crate) fn windows(&self) -> Option<Windows> {
        Some(Windows::new(
            Duration::from_secs(self.window_secs?),
            self.windows_out.clone()?,
        ))
    }
}

/// The retries of one logical request: `--max-attempts` attempts of `--request-timeout-secs`
/// (or `--attempt-timeout-ms`) each, with `--idempotency-wait-ms` if given, 20 ms doubling to 500 ms of full jitter between them (what this load generator always
/// used), no overall deadline (a logical request's latency is what is measured, not bounded).
pub(crate) fn policy(args: &Args) -> RetryPolicy {
    RetryPolicy {
        max_attempts: args.max_attempts,
        initial_backoff: Duration::from_millis(20),
        multiplier: 2.0,
        max_backoff: Duration::from_millis(500),
        deadline: Duration::MAX,
        attempt_timeout: args.attempt_timeout_ms.map_or(
            Duration::from_secs(args.request_timeout_secs),
            Duration::from_millis,
        ),
        idempotency_wait: args.idempotency_wait_ms.map(Duration::from_millis),
    }
}
