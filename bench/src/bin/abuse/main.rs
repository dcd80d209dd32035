//! The abuse campaign (issue 14, docs/security.md): attacks on a running api-server, one after
//! another, while legitimate clients keep creating rides and reading them back. Run it with
//! `bench/abuse.sh`, which starts the release api-server (production defaults: no limit lifted)
//! and fake-stripe against a scratch database.
//!
//! For each attack it reports the api-server's peak RSS and CPU, the legitimate clients'
//! latency against the quiet baseline measured first in the same run, connections the server
//! refused (its own metric), rows written by anyone but the legitimate clients, database
//! transactions, and how long until a new connection was served after the attacker let go.
//! It judges each attack against the goals of issue 14 and exits 1 if one is missed.
//!
//! Last, with the legitimate clients paused, it runs each unauthenticated attack that speaks
//! gRPC alone and counts the database transactions it caused (`footprint`).
//!
//! Beside the 16 legitimate clients runs a rider-facing backend (issue 28, `backend`): 10,000
//! cold riders per run over one connection from its own address. It runs first against
//! `--reference-target` (an api-server with every defence lifted), then alone against the
//! defaults (that window is also the quiet baseline), then under every attack, and once more
//! against the reference at the end; each run is judged against the mean of the two reference
//! runs.
//!
//! Layout: `traffic` (legitimate clients, phases), `backend`, `observe` (process, metrics and
//! database readings), `attacks/` (one file per attack), `footprint`, `report` (the table and
//! the verdicts).

mod attacks;
mod backend;
mod footprint;
mod observe;
mod report;
mod traffic;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use attacks::{Attack, Target};
use clap::Parser;
use observe::{Database, Sampler};
use rand::Rng;
use report::{AttackResult, Window};
use traffic::{Phases, time_to_serve};

#[derive(Parser)]
#[command(about = "Attacks a running api-server while legitimate clients keep working")]
struct Args {
    /// The api-server's gRPC address.
    #[arg(long)]
    target: SocketAddr,
    /// The api-server's metrics address (`METRICS_LISTEN_ADDR`).
    #[arg(long)]
    metrics: SocketAddr,
    /// The api-server's pid, whose memory and CPU are sampled.
    #[arg(long)]
    server_pid: u32,
    /// The api-server's database (users are created in it).
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Length of the quiet baseline, before any attack.
    #[arg(long, default_value_t = 20)]
    quiet_secs: u64,
    /// Length of each attack that the server's own timers do not bound.
    #[arg(long, default_value_t = 15)]
    attack_secs: u64,
    /// Attacks to run (default: all, in the documented order).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Attack>,
    /// Where to write the JSON results.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// An api-server with every defence lifted, against the same database: the backend's
    /// reference runs. Without it the backend is judged on its refusals alone.
    #[arg(long)]
    reference_target: Option<SocketAddr>,
    /// Leave the backend out (the campaign as it was before issue 28).
    #[arg(long)]
    no_backend: bool,
}

/// A new connection must be served within this long after an attack ends.
const RECOVERY_GOAL: Duration = Duration::from_secs(5);
const SETTLE: Duration = Duration::from_secs(3);
const WARM_UP: Duration = Duration::from_secs(10);

/// The attackers' scheduling priority. On this 2-core machine they share the CPU with the
/// api-server, PostgreSQL and the legitimate clients; a real attacker's CPU is its own. At the
/// lowest priority they use what the others leave (their rates are reported), so the figures
/// show what their traffic costs the server, not what their own work costs the machine.
const ATTACKER_NICE: i32 = 19;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Linux keeps a nice value per thread: every thread of this runtime (the attackers, the
    // samplers) is lowered; the legitimate clients run on a thread and runtime of their own.
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(|| {
            let _ = rustix::process::setpriority_process(None, ATTACKER_NICE);
        })
        .build()?
        .block_on(campaign(args))
}

async fn campaign(args: Args) -> anyhow::Result<()> {
    let run = format!("{:08x}", rand::rng().random::<u32>());
    let pool = schema::build_pool(
        &args.database_url,
        2,
        Duration::from_secs(30),
        schema::PlanCache::Auto,
    );
    let mut legitimate = Vec::new();
    for i in 0..args.clients {
        let (user, token) = api_server::auth::create_user(
            &pool,
            &format!("abuse-{run}-{i}@abuse.rocketrides.test"),
            &format!("cus_abuse_{run}_{i}"),
            "pm_card_visa",
        )
        .await
        .with_context(|| format!("creating legitimate user {i}"))?;
        legitimate.push((user.id, token));
    }
    let tester_token = attacker(&pool, &run, "tester", "pm_card_chargeDeclined").await?;
    let flood_token = attacker(&pool, &run, "flood", "pm_card_visa").await?;
    let legitimate_ids: Vec<i64> = legitimate.iter().map(|(id, _)| *id).collect();
    let tokens: Vec<String> = legitimate.into_iter().map(|(_, token)| token).collect();
    let probe_token = tokens
        .first()
        .cloned()
        .context("--clients must be at least 1")?;
    let probe_ride = first_ride(args.target, &probe_token).await?;
    let target = Target {
        addr: args.target,
        probe_token,
        probe_ride,
        tester_token,
        flood_token,
        server_pid: args.server_pid,
        secs: args.attack_secs,
    };

    let stop = Arc::new(AtomicBool::new(false));
    let phases = Arc::new(Phases::default());
    let sampler = Sampler::spawn(args.server_pid, Arc::clone(&stop));
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()?;
    if observe::analyze_if_no_autovacuum(pool.clone(), Arc::clone(&phases), Arc::clone(&stop))
        .await?
    {
        println!("abuse: the server runs without autovacuum; ANALYZE every 10 s stands in for it");
    }
    let clients = traffic::spawn_legitimate(args.target, tokens, &phases, &stop)?;
    // Warm-up, not measured: connections, prepared statements, the first plans.
    phases.begin();
    tokio::time::sleep(WARM_UP).await;

    let backend_on = !args.no_backend;
    let mut references = Vec::new();
    let secs = Duration::from_secs(args.quiet_secs);
    if backend_on && let Some(reference) = args.reference_target {
        phases.begin();
        references
            .push(backend::reference_run(&pool, &run, "reference-start", reference, secs).await?);
    }
    let alone_riders = match backend_on {
        true => Some(backend::riders(&pool, &run, "alone").await?),
        false => None,
    };
    println!(
        "abuse: run {run}, {} legitimate clients{}; quiet baseline for {} s",
        args.clients,
        if backend_on { " and the backend" } else { "" },
        args.quiet_secs
    );
    let window =
        |index: usize, from: Instant, db: Database| Window::new(&phases, &sampler, index, from, db);
    let db = Database::read(&pool, &legitimate_ids).await?;
    let (quiet, from) = (phases.begin(), Instant::now());
    let running = match alone_riders {
        Some(riders) => Some(backend::start(args.target, riders).await?),
        None => None,
    };
    tokio::time::sleep(Duration::from_secs(args.quiet_secs)).await;
    let backend_alone = match running {
        Some(running) => Some(running.finish().await?),
        None => None,
    };
    let baseline = window(
        quiet,
        from,
        Database::read(&pool, &legitimate_ids).await?.since(&db),
    );
    if let Some(alone) = &backend_alone {
        println!(
            "abuse: backend at the defaults, alone: {}",
            alone.cells(references.first())
        );
    }

    let attacks = if args.only.is_empty() {
        Attack::ALL.to_vec()
    } else {
        args.only.clone()
    };
    let mut results = Vec::new();
    for attack in attacks {
        let riders = match backend_on {
            true => Some(backend::riders(&pool, &run, attack.name()).await?),
            false => None,
        };
        println!("abuse: {} ...", attack.name());
        let refused_before = observe::refused_connections(&http, args.metrics).await?;
        let db = Database::read(&pool, &legitimate_ids).await?;
        let (index, from) = (phases.begin(), Instant::now());
        let running = match riders {
            Some(riders) => Some(backend::start(args.target, riders).await?),
            None => None,
        };
        let attacker = attack
            .run(&target)
            .await
            .with_context(|| format!("attack {}", attack.name()));
        let backend_seen = match running {
            Some(running) => Some(running.finish().await?),
            None => None,
        };
        let during = window(
            index,
            from,
            Database::read(&pool, &legitimate_ids).await?.since(&db),
        );
        let attacker = attacker?;
        // The recovery and settling time is a phase of its own, kept out of the attack's figures.
        phases.begin();
        let recovery = time_to_serve(
            target.addr,
            &target.probe_token,
            target.probe_ride,
            Duration::from_secs(30),
        )
        .await;
        // Writes finish and statistics are flushed within a second.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let written = Database::read(&pool, &legitimate_ids).await?.since(&db);
        let refused_after = observe::refused_connections(&http, args.metrics).await?;
        let result = AttackResult::new(
            attack,
            during,
            written,
            report::difference(&refused_before, &refused_after),
            recovery,
            attacker,
            backend_seen,
        );
        println!("{}", result.line(&baseline));
        results.push(result);
        tokio::time::sleep(SETTLE).await;
    }
    if backend_on && let Some(reference) = args.reference_target {
        phases.begin();
        references
            .push(backend::reference_run(&pool, &run, "reference-end", reference, secs).await?);
    }
    let footprints = footprint::measure(&pool, &legitimate_ids, &phases, &target).await?;
    stop.store(true, Ordering::SeqCst);
    let _ = tokio::task::spawn_blocking(move || clients.join()).await;
    let reference = backend::BackendRun::mean(&references);
    let verdict = report::print(&baseline, &results, RECOVERY_GOAL)
        & report::print_backend(
            backend_alone.as_ref(),
            &results,
            &references,
            reference.as_ref(),
        )
        & footprint::print(&footprints);
    if let Some(path) = &args.json_out {
        let json = serde_json::json!({
            "run": run,
            "quiet": baseline,
            "backend_alone": backend_alone,
            "backend_references": references,
            "attacks": results,
            "database_footprint": footprints,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if !verdict {
        std::process::exit(1);
    }
    Ok(())
}

/// An authenticated attacker's token: a user whose rows count as an attacker's.
async fn attacker(
    pool: &schema::Pool,
    run: &str,
    name: &str,
    card: &str,
) -> anyhow::Result<String> {
    let (_, token) = api_server::auth::create_user(
        pool,
        &format!("abuse-{run}-{name}@abuse.rocketrides.test"),
        &format!("cus_abuse_{run}_{name}"),
        card,
    )
    .await
    .with_context(|| format!("creating the attacker {name}"))?;
    Ok(token)
}

/// Creates one ride for the probes to read back.
async fn first_ride(target: SocketAddr, token: &str) -> anyhow::Result<i64> {
    let mut rpc = traffic::client(target, None)?;
    let created = rpc
        .create_ride(traffic::authorized(traffic::PARAMS, token, true))
        .await
        .context("the first CreateRide")?;
    created
        .into_inner()
        .ride
        .map(|ride| ride.id)
        .context("CreateRide answered without a ride")
}
