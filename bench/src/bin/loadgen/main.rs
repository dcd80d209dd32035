//! `loadgen`: N concurrent gRPC clients calling `rides.v1.RideService/CreateRide`.
//!
//! Each logical request uses a fresh idempotency key, or (with `--replay-ratio`) the key of a
//! request this client already finished, with the same parameters. Each logical request is one
//! `rides-client` call: retryable answers are retried with the same key, with exponential
//! backoff and full jitter (20 ms doubling to 500 ms, never under the server's `RetryInfo`), up
//! to `--max-attempts`, with no overall deadline. The latency of a logical request runs from its
//! first attempt to its final answer.
//!
//! Each client is a closed loop on one user (by default), hundreds of calls per second: far
//! above the api-server's per-user limits (`RATE_LIMIT_*`, `MAX_CONCURRENT_CREATES_PER_USER`),
//! which `bench/run.sh` lifts on the api-server it starts for those scenarios. Against a server
//! with the defaults, expect `RESOURCE_EXHAUSTED` answers.
//!
//! With `--riders N` the clients are instead a rider-facing backend: N users are created (their
//! tokens cold on a freshly started api-server, which has never seen them) and each request with
//! a fresh key takes a random one of them, so each rider calls rarely, as real riders do. A replay
//! calls as the rider that made its key (the seeded keys are spread over the pool round-robin);
//! with `--seed-target` the keys are made through another api-server, so that the replays meet
//! tokens the measured one has never seen, as after a restart.
//! That is the shape the api-server's defaults are meant to serve, and `bench/run.sh` measures it
//! at the defaults.
//!
//! While the load runs it samples the scratch database's `pg_stat_activity` (what the server's
//! connections wait on), the api-server's VmRSS, and the CPU time of the processes involved; over
//! the measured window it counts the database's commits and, with `--metrics-url`, how full the
//! api-server's batched statements ran (`bench::server_counters`). At
//! the end it checks the database (rides, charged rides, finished keys, staged jobs) and the
//! provider's ledger (`GET /v1/payment_intents?customer=…`) against the number of keys that
//! succeeded, and prints PASS or FAIL. Users are created through `api_server::auth::create_user`
//! with the payment method `pm_card_visa`.
//!
//! With `--window-secs` (a soak, `bench/soak.sh`) it also writes the figures of every window of
//! the run as it closes.
//!
//! (The layout: `args.rs` the command line; `clients.rs` the users, connections and closed loops;
//! `samplers.rs` what is sampled while the load runs; `figures.rs` what is printed and written;
//! `windows.rs` the per-window figures; `check.rs` the end-of-run check.)

mod args;
mod check;
mod clients;
mod figures;
mod samplers;
mod windows;

use std::{
    sync::{Arc, atomic::AtomicU64},
    time::{Duration, Instant},
};

use bench::procfs::load_average;
use clap::Parser;
use rand::Rng;

use crate::{
    args::{Args, policy},
    clients::Shared,
    figures::Figures,
    samplers::Samplers,
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.validate()?;
    let run_id = format!("{:08x}", rand::rng().random::<u32>());
    let started_at_load = load_average();
    let users = clients::create_users(&args, &run_id).await?;
    let channels = clients::connect(&args, &args.target).await?;
    let seeded = match &args.seed_target {
        Some(seed_target) => {
            let seed_channels = clients::connect(&args, seed_target).await?;
            clients::seed(&args, &run_id, &users, &seed_channels).await?
        }
        None => clients::seed(&args, &run_id, &users, &channels).await?,
    };

    // The measured run: after the warm-up, until the deadline or the request budget.
    let measure_from = Instant::now() + Duration::from_secs_f64(args.warmup_secs.max(0.0));
    let deadline = match args.requests {
        Some(_) => None,
        None => Some(measure_from + Duration::from_secs_f64(args.duration_secs.unwrap_or(10.0))),
    };
    let samplers = Samplers::start(&args, measure_from)?;
    let windows = args.windows().map(Arc::new);
    let window_task = windows
        .as_ref()
        .map(|windows| windows.spawn(measure_from, deadline));
    let shared = Arc::new(Shared {
        run_id: run_id.clone(),
        policy: policy(&args),
        replay_ratio: args.replay_ratio,
        resend_replays: !args.replays_as_first_sends,
        measure_from,
        deadline,
        remaining: args.requests.map(AtomicU64::new),
        windows,
    });
    let total = clients::run(&args, &shared, &users, &channels, seeded).await?;
    if let Some(task) = window_task {
        task.await??;
    }
    let elapsed = Instant::now().saturating_duration_since(measure_from.min(Instant::now()));
    let sampled = samplers.finish(&args).await?;

    let figures = Figures::new(&total, &sampled, elapsed);
    figures.print(&args, users.len(), channels.len(), &total, &sampled);
    println!(
        "load average: start {started_at_load}, end {}",
        sampled.ended_at_load
    );
    let check = if args.no_check {
        None
    } else {
        Some(check::check(&args, &users, &total).await?)
    };
    let check_pass = check.as_ref().map(|c| c.0);
    if let Some(path) = &args.json_out {
        let shape = figures::Shape {
            users: users.len(),
            connections: channels.len(),
            started_at_load: &started_at_load,
        };
        let summary = figures.summary(&args, &shape, &total, &sampled, check);
        figures::append_json(path, &summary)?;
    }
    if check_pass == Some(false) {
        std::process::exit(2);
    }
    Ok(())
}
