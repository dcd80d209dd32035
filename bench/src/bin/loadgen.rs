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
//! tokens cold on a freshly started api-server, which has never seen them) and each request
//! takes a random one of them, so each rider calls rarely, as real riders do. That is the shape
//! the api-server's defaults are meant to serve (issue 28), and `bench/run.sh` measures it at
//! the defaults.
//!
//! While the load runs it samples the scratch database's `pg_stat_activity` (what the server's
//! connections wait on), the api-server's VmRSS, and the CPU time of the processes involved; over
//! the measured window it counts the database's commits and, with `--metrics-url`, how full the
//! api-server's batched statements ran (`bench::server_counters`). At
//! the end it checks the database (rides, charged rides, finished keys, staged jobs) and the
//! provider's ledger (`GET /v1/payment_intents?customer=…`) against the number of keys that
//! succeeded, and prints PASS or FAIL. Users are created through `api_server::auth::create_user`
//! with the payment method `pm_card_visa`.

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use bench::{
    latency::Latencies,
    procfs::{cpu_ticks, load_average, machine_ticks, pids_named, vm_rss_kb},
    server_counters::{self, BatchTotals},
};
use clap::Parser;
use diesel::{
    QueryableByName,
    sql_types::{Array, BigInt, Text},
};
use diesel_async::RunQueryDsl;
use futures_util::{StreamExt, TryStreamExt};
use proto::v1::CreateRideRequest;
use rand::Rng;
use rides_client::{AttemptRecord, Credential, RetryPolicy, RidesClient};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    name = "loadgen",
    about = "CreateRide load generator for the Rocket Rides api-server"
)]
struct Args {
    /// The api-server's gRPC endpoint (`https://` for TLS).
    #[arg(long, default_value = "http://127.0.0.1:25151")]
    target: String,
    /// CA certificate (PEM) that signed the api-server's, for an `https://` target.
    #[arg(long, env = "API_SERVER_CA")]
    ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for mutual TLS; needs --client-key.
    #[arg(long, env = "API_SERVER_CLIENT_CERT")]
    client_cert: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "API_SERVER_CLIENT_KEY")]
    client_key: Option<std::path::PathBuf>,
    /// The api-server's database (users are created here; the check reads it).
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// fake-stripe's base URL, for the ledger check.
    #[arg(long, default_value = "http://127.0.0.1:12211")]
    stripe_base: String,
    #[arg(long, default_value = "sk_test_rocket_rides_development")]
    stripe_key: String,
    /// Concurrent clients (each one request at a time).
    #[arg(long, default_value_t = 8)]
    clients: u32,
    /// Measured duration; ignored when --requests is given. Default 10 s.
    #[arg(long)]
    duration_secs: Option<f64>,
    /// Total logical requests instead of a duration.
    #[arg(long)]
    requests: Option<u64>,
    /// Requests at the start whose latency and rate are not counted (still checked).
    #[arg(long, default_value_t = 1.0)]
    warmup_secs: f64,
    /// Fraction of requests that replay a key this client already finished.
    #[arg(long, default_value_t = 0.0)]
    replay_ratio: f64,
    /// Keys each client finishes before the measurement, as replay material.
    #[arg(long, default_value_t = 0)]
    seed_keys_per_client: u32,
    /// Users to create (clients share them round-robin). Default: one per client.
    #[arg(long, conflicts_with = "riders")]
    users: Option<u32>,
    /// A rider pool instead of closed-loop users: this many users, and each request takes a
    /// random one of them. Not with replays (a key belongs to the rider that made it).
    #[arg(long)]
    riders: Option<u32>,
    /// Users created at once (each is one INSERT): 10,000 riders one at a time take a while.
    #[arg(long, default_value_t = 4)]
    create_users_concurrency: usize,
    /// HTTP/2 connections to the server (clients share them round-robin). Default: one per 50
    /// clients, so that the server's concurrent-stream limit never throttles the clients.
    #[arg(long)]
    connections: Option<u32>,
    /// Attempts per logical request before it counts as failed.
    #[arg(long, default_value_t = 12)]
    max_attempts: u32,
    /// Deadline of one attempt.
    #[arg(long, default_value_t = 60)]
    request_timeout_secs: u64,
    /// Deadline of one attempt in milliseconds, instead of --request-timeout-secs: a client that
    /// gives up on an attempt after a short client-side timeout and retries with the same key.
    #[arg(long)]
    attempt_timeout_ms: Option<u64>,
    /// `idempotency-wait` of every attempt (`0`: do not wait for an attempt in flight with the
    /// same key, answer IDEMPOTENCY_KEY_IN_USE at once). Default: not sent, the server's maximum.
    #[arg(long)]
    idempotency_wait_ms: Option<u64>,
    /// Scenario name, for the report.
    #[arg(long, default_value = "adhoc")]
    scenario: String,
    /// The provider latency fake-stripe was started with (only recorded, for the ceiling).
    #[arg(long, default_value_t = 0)]
    provider_latency_ms: u64,
    /// The api-server's pid: its VmRSS is sampled and its CPU time measured.
    #[arg(long)]
    server_pid: Option<u32>,
    /// More processes whose CPU time is measured, as NAME=PID (e.g. fake-stripe=1234).
    #[arg(long)]
    cpu_pid: Vec<String>,
    /// The api-server's Prometheus endpoint (`http://…/metrics`): its batch-size histogram is
    /// read at the start and the end of the measured window for the batch fill per statement.
    #[arg(long)]
    metrics_url: Option<String>,
    /// Append the JSON summary as one line to this file.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Skip the database and ledger check.
    #[arg(long)]
    no_check: bool,
}

const PARAMS: CreateRideRequest = CreateRideRequest {
    origin_lat: Some(37.7749),
    origin_lon: Some(-122.4194),
    target_lat: Some(37.3382),
    target_lon: Some(-121.8863),
};

struct BenchUser {
    id: i64,
    token: String,
    customer: String,
}

/// What one client saw.
#[derive(Default)]
struct ClientStats {
    latencies: Latencies,
    /// Every attempt's answer, by `CODE/REASON`.
    attempts: BTreeMap<String, u64>,
    /// Measured window: logical requests finished, and those that succeeded.
    measured_done: u64,
    measured_ok: u64,
    /// New keys that ended in success (whole run, warm-up and seeding included).
    new_keys_ok: u64,
    /// New keys that ended in anything else after all retries.
    new_keys_failed: u64,
    replays_ok: u64,
    /// Replays of a finished key that did not come back as `idempotent-replayed: true`.
    replays_not_marked: u64,
    replays_failed: u64,
    aborted: u64,
}

struct Shared {
    run_id: String,
    policy: RetryPolicy,
    replay_ratio: f64,
    measure_from: Instant,
    deadline: Option<Instant>,
    remaining: Option<AtomicU64>,
}

enum Final {
    Ok { replayed: bool },
    Err,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.clients == 0 {
        bail!("--clients must be at least 1");
    }
    if !(0.0..=1.0).contains(&args.replay_ratio) {
        bail!("--replay-ratio must be within 0..=1");
    }
    if args.riders.is_some() && (args.replay_ratio > 0.0 || args.seed_keys_per_client > 0) {
        bail!("--riders takes no replays: a key belongs to the rider that made it");
    }
    let run_id = format!("{:08x}", rand::rng().random::<u32>());
    let started_at_load = load_average();

    let concurrency = args.create_users_concurrency.max(1);
    let pool = schema::build_pool(
        &args.database_url,
        u32::try_from(concurrency).unwrap_or(u32::MAX),
        Duration::from_secs(30),
        schema::PlanCache::Auto,
    );
    let user_count = args.riders.or(args.users).unwrap_or(args.clients).max(1);
    let created_from = Instant::now();
    let riders = args.riders.is_some();
    let users: Vec<Arc<BenchUser>> = futures_util::stream::iter(0..user_count)
        .map(|i| {
            let pool = &pool;
            let customer = format!("cus_bench_{run_id}_{i}");
            let email = format!("bench-{run_id}-{i}@bench.rocketrides.test");
            async move {
                let (user, token) =
                    api_server::auth::create_user(pool, &email, &customer, "pm_card_visa")
                        .await
                        .with_context(|| format!("cannot create bench user {i}"))?;
                anyhow::Ok(Arc::new(BenchUser {
                    id: user.id,
                    token,
                    customer,
                }))
            }
        })
        .buffer_unordered(concurrency)
        .try_collect()
        .await?;
    if riders {
        eprintln!(
            "created {} riders in {:.1} s",
            users.len(),
            created_from.elapsed().as_secs_f64()
        );
    }

    let connections = args
        .connections
        .unwrap_or_else(|| args.clients.div_ceil(50))
        .max(1);
    let tls = proto::client::ClientTls {
        ca: args.ca.clone(),
        cert: args.client_cert.clone(),
        key: args.client_key.clone(),
    };
    let mut channels = Vec::new();
    for _ in 0..connections {
        let channel = proto::client::endpoint(&args.target, &tls)?
            .connect()
            .await
            .with_context(|| format!("cannot connect to {}", args.target))?;
        channels.push(channel);
    }

    // Seeding: finished keys to replay, made before the clock starts.
    let seed_shared = Arc::new(Shared {
        run_id: run_id.clone(),
        policy: policy(&args),
        replay_ratio: 0.0,
        measure_from: Instant::now() + Duration::from_secs(86_400),
        deadline: None,
        remaining: None,
    });
    let mut seeded: Vec<(ClientStats, Vec<String>)> = Vec::new();
    if args.seed_keys_per_client > 0 {
        let mut tasks = Vec::new();
        for client in 0..args.clients {
            let shared = Arc::clone(&seed_shared);
            let user = Arc::clone(&users[client as usize % users.len()]);
            let rpc = rides_client(
                &channels[client as usize % channels.len()],
                &user,
                &shared.policy,
            );
            let seeds = args.seed_keys_per_client;
            tasks.push(tokio::spawn(async move {
                let mut stats = ClientStats::default();
                let mut finished = Vec::new();
                for n in 0..seeds {
                    let key = format!("bench-{}-seed-{client:05}-{n:09}", shared.run_id);
                    if let Final::Ok { .. } = request(&shared, &rpc, &key, &mut stats, false).await
                    {
                        finished.push(key);
                    }
                }
                (stats, finished)
            }));
        }
        for task in tasks {
            seeded.push(task.await?);
        }
        eprintln!(
            "seeded {} finished keys",
            seeded.iter().map(|(_, keys)| keys.len()).sum::<usize>()
        );
    }

    // Samplers: wait events, RSS, CPU.
    let stop = Arc::new(AtomicBool::new(false));
    let waits = tokio::spawn(sample_wait_events(
        args.database_url.clone(),
        Arc::clone(&stop),
    ));
    let rss = args
        .server_pid
        .map(|pid| tokio::spawn(sample_rss(pid, Arc::clone(&stop))));
    let mut cpu_groups: Vec<(String, Vec<u32>)> =
        vec![("loadgen".to_owned(), vec![std::process::id()])];
    if let Some(pid) = args.server_pid {
        cpu_groups.push(("api-server".to_owned(), vec![pid]));
    }
    for spec in &args.cpu_pid {
        let (name, pid) = spec.split_once('=').context("--cpu-pid takes NAME=PID")?;
        cpu_groups.push((name.to_owned(), vec![pid.parse()?]));
    }

    // The measured run.
    let started = Instant::now();
    let measure_from = started + Duration::from_secs_f64(args.warmup_secs.max(0.0));
    let deadline = match args.requests {
        Some(_) => None,
        None => Some(measure_from + Duration::from_secs_f64(args.duration_secs.unwrap_or(10.0))),
    };
    let shared = Arc::new(Shared {
        run_id: run_id.clone(),
        policy: policy(&args),
        replay_ratio: args.replay_ratio,
        measure_from,
        deadline,
        remaining: args.requests.map(AtomicU64::new),
    });
    // CPU is counted over the measured window only, and the database's backends are listed
    // when it opens: a freshly started api-server opens its pooled connections during the
    // warm-up, so a list taken before it missed most of them.
    let cpu_start = tokio::spawn({
        let url = args.database_url.clone();
        let metrics_url = args.metrics_url.clone();
        let mut cpu_groups = cpu_groups;
        async move {
            tokio::time::sleep_until(measure_from.into()).await;
            let counters = ServerCounters::read(&url, metrics_url.as_deref()).await;
            let backends = database_backends(&url).await.unwrap_or_default();
            cpu_groups.push(("postgres (this db's backends)".to_owned(), backends));
            cpu_groups.push((
                "postgres (all processes)".to_owned(),
                pids_named("postgres"),
            ));
            let cpu_before: Vec<u64> = cpu_groups.iter().map(|(_, pids)| cpu_ticks(pids)).collect();
            (cpu_groups, cpu_before, machine_ticks(), counters)
        }
    });
    let mut seeded = seeded.into_iter();
    let mut tasks = Vec::new();
    let rider_pool = riders.then(|| Arc::new(users.clone()));
    for client in 0..args.clients {
        let shared = Arc::clone(&shared);
        let user = Arc::clone(&users[client as usize % users.len()]);
        let channel = channels[client as usize % channels.len()].clone();
        let rpc = rides_client(&channel, &user, &shared.policy);
        let rider_pool = rider_pool.clone();
        let (seed_stats, finished) = seeded.next().unwrap_or_default();
        tasks.push(tokio::spawn(async move {
            let mut stats = ClientStats::default();
            let mut finished = finished;
            let mut n: u64 = 0;
            loop {
                if let Some(deadline) = shared.deadline
                    && Instant::now() >= deadline
                {
                    break;
                }
                if let Some(remaining) = &shared.remaining
                    && remaining
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| r.checked_sub(1))
                        .is_err()
                {
                    break;
                }
                let replay = !finished.is_empty()
                    && shared.replay_ratio > 0.0
                    && rand::rng().random::<f64>() < shared.replay_ratio;
                let key = if replay {
                    finished[rand::rng().random_range(0..finished.len())].clone()
                } else {
                    n += 1;
                    format!("bench-{}-c{client:05}-{n:012}", shared.run_id)
                };
                let outcome = match &rider_pool {
                    Some(riders) => {
                        let rider = &riders[rand::rng().random_range(0..riders.len())];
                        let rpc = rides_client(&channel, rider, &shared.policy);
                        request(&shared, &rpc, &key, &mut stats, replay).await
                    }
                    None => request(&shared, &rpc, &key, &mut stats, replay).await,
                };
                if !replay
                    && shared.replay_ratio > 0.0
                    && matches!(outcome, Final::Ok { .. })
                    && finished.len() < 100_000
                {
                    finished.push(key);
                }
            }
            (seed_stats, stats)
        }));
    }
    let mut total = ClientStats::default();
    for task in tasks {
        let (seed_stats, stats) = task.await?;
        total.absorb(seed_stats);
        total.absorb(stats);
    }
    let elapsed = Instant::now().saturating_duration_since(measure_from.min(Instant::now()));
    stop.store(true, Ordering::SeqCst);
    let (cpu_groups, cpu_before, machine_before, counters_before) = cpu_start.await?;
    let cpu_after: Vec<u64> = cpu_groups.iter().map(|(_, pids)| cpu_ticks(pids)).collect();
    let machine_after = machine_ticks();
    let counters_after =
        ServerCounters::read(&args.database_url, args.metrics_url.as_deref()).await;
    let wait_samples = waits.await?.unwrap_or_else(|error| {
        eprintln!("wait-event sampling failed: {error:#}");
        (0, BTreeMap::new())
    });
    let rss = match rss {
        Some(task) => Some(task.await?),
        None => None,
    };
    let ended_at_load = load_average();

    // Report.
    let secs = elapsed.as_secs_f64().max(1e-9);
    let throughput = total.measured_ok as f64 / secs;
    let p = total.latencies.percentiles();
    let ticks_per_s = bench::procfs::TICKS_PER_SEC as f64;
    let cpu: BTreeMap<String, f64> = cpu_groups
        .iter()
        .zip(cpu_before.iter().zip(&cpu_after))
        .map(|((name, _), (before, after))| {
            (
                name.clone(),
                after.saturating_sub(*before) as f64 / ticks_per_s / secs,
            )
        })
        .collect();
    let machine_busy = match (machine_before, machine_after) {
        (Some((busy0, all0)), Some((busy1, all1))) if all1 > all0 => {
            Some((busy1 - busy0) as f64 / (all1 - all0) as f64)
        }
        _ => None,
    };
    // Per request of the window: CPU in each process group, and the database's commits.
    let per_request =
        |value: f64| (total.measured_done > 0).then(|| value * secs / total.measured_done as f64);
    let cpu_ms_per_request: BTreeMap<String, f64> = cpu
        .iter()
        .filter_map(|(name, cores)| Some((name.clone(), per_request(cores * 1000.0)?)))
        .collect();
    let commits_per_request = match (counters_before.commits, counters_after.commits) {
        (Some(before), Some(after)) => per_request((after - before) as f64 / secs),
        _ => None,
    };
    let batch_fill = server_counters::batch_fill(&counters_before.batches, &counters_after.batches);
    let per_logical_request = |before: Option<f64>, after: Option<f64>| {
        let (before, after) = (before?, after?);
        (total.measured_done > 0).then(|| (after - before) / total.measured_done as f64)
    };
    let claim_statements_per_request = per_logical_request(
        counters_before.claim_statements,
        counters_after.claim_statements,
    );
    let wait_polls_per_request =
        per_logical_request(counters_before.wait_polls, counters_after.wait_polls);
    let (samples, waits) = wait_samples;
    let waits_avg: BTreeMap<String, f64> = waits
        .iter()
        .map(|(k, v)| (k.clone(), *v as f64 / samples.max(1) as f64))
        .collect();

    println!(
        "scenario {}  clients {}  users {}  connections {}",
        args.scenario,
        args.clients,
        users.len(),
        connections
    );
    println!(
        "measured {:.2} s: {} requests, {} succeeded -> {:.1} CreateRide/s",
        secs, total.measured_done, total.measured_ok, throughput
    );
    println!(
        "latency ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2}  mean {:.2}",
        p.p50_ms, p.p90_ms, p.p99_ms, p.max_ms, p.mean_ms
    );
    let not_ok: BTreeMap<&String, &u64> = total
        .attempts
        .iter()
        .filter(|(label, _)| !label.starts_with("OK"))
        .collect();
    println!(
        "non-OK answers (every attempt, warm-up included): {} {:?}",
        not_ok.values().copied().sum::<u64>(),
        not_ok
    );
    println!("attempt outcomes (code/reason):");
    for (outcome, count) in &total.attempts {
        println!("  {outcome:<55} {count}");
    }
    println!(
        "keys: new ok {}  new failed {}  replays ok {}  replays not marked replayed {}  replays failed {}",
        total.new_keys_ok,
        total.new_keys_failed,
        total.replays_ok,
        total.replays_not_marked,
        total.replays_failed
    );
    println!("CPU (cores busy on average over the run; 2 cores total):");
    for (name, cores) in &cpu {
        let per = cpu_ms_per_request
            .get(name)
            .map_or_else(String::new, |ms| format!("  ({ms:.3} ms per request)"));
        println!("  {name:<32} {cores:.2}{per}");
    }
    if let Some(busy) = machine_busy {
        println!("  machine total busy fraction     {busy:.2}");
    }
    if let Some(commits) = commits_per_request {
        println!("database commits per request (pg_stat_database, this database): {commits:.2}");
    }
    if let (Some(claims), Some(polls)) = (claim_statements_per_request, wait_polls_per_request) {
        println!(
            "claim statements per logical request: {claims:.2}  (waiters' key reads: {polls:.2})"
        );
    }
    if !batch_fill.is_empty() {
        println!("batch fill (requests per batched statement, mean over the window):");
        for (statement, fill) in &batch_fill {
            println!("  {statement:<32} {fill:.2}");
        }
    }
    println!(
        "pg_stat_activity of this database, non-idle backends per sample ({samples} samples):"
    );
    let mut sorted: Vec<_> = waits_avg.iter().collect();
    sorted.sort_by(|a, b| b.1.total_cmp(a.1));
    for (what, avg) in sorted.iter().take(12) {
        println!("  {what:<55} {avg:.2}");
    }
    if let Some((peak, last)) = rss {
        println!(
            "api-server VmRSS: peak {:.1} MB, end {:.1} MB",
            peak as f64 / 1024.0,
            last as f64 / 1024.0
        );
    }
    println!("load average: start {started_at_load}, end {ended_at_load}");

    let check = if args.no_check {
        None
    } else {
        Some(check(&args, &users, &total).await?)
    };
    let check_pass = check.as_ref().map(|c| c.0);

    let summary = json!({
        "kind": "loadgen",
        "scenario": args.scenario,
        "clients": args.clients,
        "users": users.len(),
        "riders": args.riders,
        "max_attempts": args.max_attempts,
        "connections": connections,
        "replay_ratio": args.replay_ratio,
        "provider_latency_ms": args.provider_latency_ms,
        "seconds": secs,
        "requests": total.measured_done,
        "successes": total.measured_ok,
        "throughput": throughput,
        "p50_ms": p.p50_ms, "p90_ms": p.p90_ms, "p99_ms": p.p99_ms, "max_ms": p.max_ms, "mean_ms": p.mean_ms,
        "attempts": total.attempts,
        "conflicts_surfaced": total.aborted,
        "failed": total.new_keys_failed + total.replays_failed,
        "new_keys_ok": total.new_keys_ok,
        "replays_ok": total.replays_ok,
        "replays_not_marked": total.replays_not_marked,
        "check_pass": check_pass,
        "check": check.map(|c| c.1),
        "cpu_cores": cpu,
        "cpu_ms_per_request": cpu_ms_per_request,
        "commits_per_request": commits_per_request,
        "batch_fill": batch_fill,
        "claim_statements_per_request": claim_statements_per_request,
        "wait_polls_per_request": wait_polls_per_request,
        "attempt_timeout_ms": args.attempt_timeout_ms,
        "idempotency_wait_ms": args.idempotency_wait_ms,
        "machine_busy": machine_busy,
        "pg_waits_avg_backends": waits_avg,
        "server_rss_peak_kb": rss.map(|r| r.0),
        "server_rss_end_kb": rss.map(|r| r.1),
        "load_avg": format!("{started_at_load} -> {ended_at_load}"),
    });
    if let Some(path) = &args.json_out {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        writeln!(file, "{summary}")?;
    }
    if check_pass == Some(false) {
        std::process::exit(2);
    }
    Ok(())
}

impl ClientStats {
    fn absorb(&mut self, other: ClientStats) {
        self.latencies.merge(&other.latencies);
        for (k, v) in other.attempts {
            *self.attempts.entry(k).or_default() += v;
        }
        self.measured_done += other.measured_done;
        self.measured_ok += other.measured_ok;
        self.new_keys_ok += other.new_keys_ok;
        self.new_keys_failed += other.new_keys_failed;
        self.replays_ok += other.replays_ok;
        self.replays_not_marked += other.replays_not_marked;
        self.replays_failed += other.replays_failed;
        self.aborted += other.aborted;
    }
}

/// The retries of one logical request: `--max-attempts` attempts of `--request-timeout-secs`
/// (or `--attempt-timeout-ms`) each, with `--idempotency-wait-ms` if given, 20 ms doubling to 500 ms of full jitter between them (what this load generator always
/// used), no overall deadline (a logical request's latency is what is measured, not bounded).
fn policy(args: &Args) -> RetryPolicy {
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

/// A client task's `rides-client`, as its user, over one of the shared connections.
fn rides_client(
    channel: &tonic::transport::Channel,
    user: &BenchUser,
    policy: &RetryPolicy,
) -> RidesClient {
    RidesClient::new(channel.clone(), Credential::user(user.token.as_str()))
        .with_policy(policy.clone())
}

/// One logical request: one `rides-client` call, which retries with the same key until a final
/// answer. Every attempt's answer is counted by its `CODE/REASON` label.
async fn request(
    shared: &Shared,
    rpc: &RidesClient,
    key: &str,
    stats: &mut ClientStats,
    replay: bool,
) -> Final {
    let started = Instant::now();
    let result = rpc.create_ride_with_key(key, PARAMS).await;
    let (log, outcome): (&[AttemptRecord], Final) = match &result {
        Ok(created) => (
            &created.log,
            Final::Ok {
                replayed: created.replayed,
            },
        ),
        Err(error) => (&error.log, Final::Err),
    };
    for attempt in log {
        let label = match (&outcome, attempt.outcome.as_str()) {
            (Final::Ok { replayed: true }, "OK") => "OK (replayed)",
            (_, label) => label,
        };
        *stats.attempts.entry(label.to_owned()).or_default() += 1;
        if label.starts_with("Aborted/") {
            stats.aborted += 1;
        }
    }
    if let Err(error) = &result
        && error.log.is_empty()
    {
        // Nothing was sent (the token or key cannot be metadata).
        *stats.attempts.entry(error.error.label()).or_default() += 1;
    }
    let measured = started >= shared.measure_from;
    if measured {
        stats.latencies.record(started.elapsed());
        stats.measured_done += 1;
    }
    match (&outcome, replay) {
        (Final::Ok { .. }, false) => stats.new_keys_ok += 1,
        (Final::Err, false) => stats.new_keys_failed += 1,
        (Final::Ok { replayed }, true) => {
            stats.replays_ok += 1;
            if !replayed {
                stats.replays_not_marked += 1;
            }
        }
        (Final::Err, true) => stats.replays_failed += 1,
    }
    if measured && matches!(outcome, Final::Ok { .. }) {
        stats.measured_ok += 1;
    }
    outcome
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct WaitRow {
    #[diesel(sql_type = Text)]
    what: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The server-side counters read at each end of the measured window.
struct ServerCounters {
    /// `pg_stat_database.xact_commit` of the database (its statistics lag by up to a second,
    /// a few percent of a 15 s window).
    commits: Option<i64>,
    batches: BTreeMap<String, BatchTotals>,
    /// The api-server's claim statements and waiters' key reads (with --metrics-url).
    claim_statements: Option<f64>,
    wait_polls: Option<f64>,
}

impl ServerCounters {
    async fn read(database_url: &str, metrics_url: Option<&str>) -> Self {
        let commits = match database_commits(database_url).await {
            Ok(commits) => Some(commits),
            Err(error) => {
                eprintln!("reading pg_stat_database failed: {error:#}");
                None
            }
        };
        let exposition = match metrics_url {
            Some(url) => scrape(url)
                .await
                .inspect_err(|error| eprintln!("reading {url} failed: {error:#}"))
                .ok(),
            None => None,
        };
        let text = exposition.as_deref().unwrap_or_default();
        ServerCounters {
            commits,
            batches: server_counters::batch_totals(text),
            // Absent once scraped: none counted yet.
            claim_statements: exposition.as_ref().map(|text| {
                server_counters::counter_total(text, server_counters::CLAIM_STATEMENTS)
                    .unwrap_or(0.0)
            }),
            wait_polls: exposition.as_ref().map(|text| {
                server_counters::counter_total(text, server_counters::WAIT_POLLS).unwrap_or(0.0)
            }),
        }
    }
}

#[derive(QueryableByName)]
struct CommitsRow {
    #[diesel(sql_type = BigInt)]
    commits: i64,
}

async fn database_commits(url: &str) -> anyhow::Result<i64> {
    let mut conn = schema::connect(url).await?;
    let row: CommitsRow = diesel::sql_query(
        "SELECT xact_commit AS commits FROM pg_stat_database WHERE datname = current_database()",
    )
    .get_result(&mut conn)
    .await?;
    Ok(row.commits)
}

async fn scrape(url: &str) -> anyhow::Result<String> {
    let response = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await?
        .error_for_status()?;
    Ok(response.text().await?)
}

#[derive(QueryableByName)]
struct PidRow {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pid: i32,
}

/// Every 100 ms: the backends of this database that are not idle, by state and wait event
/// ("CPU" when not waiting). Returns the sample count and the summed counts.
async fn sample_wait_events(
    url: String,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<(u64, BTreeMap<String, u64>)> {
    let mut conn = schema::connect(&url).await?;
    let mut totals = BTreeMap::new();
    let mut samples = 0;
    while !AtomicBool::load(&stop, Ordering::SeqCst) {
        let rows: Vec<WaitRow> = diesel::sql_query(
            "SELECT state || ' / ' || coalesce(wait_event_type || ':' || wait_event, 'CPU') AS what, \
                    count(*) AS n \
             FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND backend_type = 'client backend' AND state <> 'idle' \
             GROUP BY 1",
        )
        .load(&mut conn)
        .await?;
        for row in rows {
            *totals.entry(row.what).or_insert(0) += u64::try_from(row.n).unwrap_or(0);
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((samples, totals))
}

async fn database_backends(url: &str) -> anyhow::Result<Vec<u32>> {
    let mut conn = schema::connect(url).await?;
    let rows: Vec<PidRow> = diesel::sql_query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    .load(&mut conn)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| u32::try_from(r.pid).ok())
        .collect())
}

/// Peak and last VmRSS of `pid`, in kB, sampled every 200 ms.
async fn sample_rss(pid: u32, stop: Arc<AtomicBool>) -> (u64, u64) {
    let (mut peak, mut last) = (0, 0);
    while !AtomicBool::load(&stop, Ordering::SeqCst) {
        if let Some(kb) = vm_rss_kb(pid) {
            peak = peak.max(kb);
            last = kb;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (peak, last)
}

/// Rides, charged rides, finished keys, staged jobs and provider PaymentIntents of this run's
/// users must each equal the number of keys that succeeded.
async fn check(
    args: &Args,
    users: &[Arc<BenchUser>],
    total: &ClientStats,
) -> anyhow::Result<(bool, serde_json::Value)> {
    let expected = i64::try_from(total.new_keys_ok)?;
    let ids: Vec<i64> = users.iter().map(|u| u.id).collect();
    let mut conn = schema::connect(&args.database_url).await?;
    let mut count = async |sql: &str| -> anyhow::Result<i64> {
        let row: Count = diesel::sql_query(sql)
            .bind::<Array<BigInt>, _>(&ids)
            .get_result(&mut conn)
            .await
            .with_context(|| format!("check query failed: {sql}"))?;
        Ok(row.n)
    };
    let rides = count("SELECT count(*) AS n FROM rides WHERE user_id = ANY($1)").await?;
    let charged = count(
        "SELECT count(*) AS n FROM rides WHERE user_id = ANY($1) AND stripe_charge_id IS NOT NULL",
    )
    .await?;
    let finished = count(
        "SELECT count(*) AS n FROM idempotency_keys WHERE user_id = ANY($1) AND recovery_point = 'finished'",
    )
    .await?;
    let staged = count(
        "SELECT count(*) AS n FROM staged_jobs WHERE (job_args->>'user_id')::bigint = ANY($1)",
    )
    .await?;
    let ledger = ledger_count(args, users).await?;
    let pass = [rides, charged, finished, staged, ledger]
        .iter()
        .all(|n| *n == expected);
    println!(
        "check: succeeded keys {expected}; rides {rides}, charged rides {charged}, finished keys {finished}, \
         staged jobs {staged}, fake-stripe PaymentIntents {ledger} -> {}",
        if pass { "PASS" } else { "FAIL" }
    );
    Ok((
        pass,
        json!({
            "expected": expected, "rides": rides, "charged_rides": charged,
            "finished_keys": finished, "staged_jobs": staged, "payment_intents": ledger,
        }),
    ))
}

/// PaymentIntents of this run's customers, paginated 100 at a time; 8 customers at once (a
/// rider pool has 10,000).
async fn ledger_count(args: &Args, users: &[Arc<BenchUser>]) -> anyhow::Result<i64> {
    let http = reqwest::Client::new();
    let counts: Vec<i64> = futures_util::stream::iter(users)
        .map(|user| customer_intents(args, &http, &user.customer))
        .buffer_unordered(8)
        .try_collect()
        .await?;
    Ok(counts.iter().sum())
}

async fn customer_intents(
    args: &Args,
    http: &reqwest::Client,
    customer: &str,
) -> anyhow::Result<i64> {
    let mut total = 0_i64;
    let mut starting_after: Option<String> = None;
    for _page in 0..100_000 {
        let mut query: Vec<(&str, String)> = vec![
            ("limit", "100".to_owned()),
            ("customer", customer.to_owned()),
        ];
        if let Some(after) = &starting_after {
            query.push(("starting_after", after.clone()));
        }
        let page: HashMap<String, serde_json::Value> = http
            .get(format!("{}/v1/payment_intents", args.stripe_base))
            .bearer_auth(&args.stripe_key)
            .query(&query)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let data = page
            .get("data")
            .and_then(|d| d.as_array())
            .context("payment_intents list without data")?;
        total += i64::try_from(data.len())?;
        let has_more = page
            .get("has_more")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        starting_after = data
            .last()
            .and_then(|pi| pi.get("id"))
            .and_then(|id| id.as_str())
            .map(str::to_owned);
        if !has_more || starting_after.is_none() {
            break;
        }
    }
    Ok(total)
}
