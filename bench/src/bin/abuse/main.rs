//! The abuse campaign (docs/security.md): attacks on a running api-server, one after
//! another, while legitimate clients keep creating rides and reading them back. Run it with
//! `bench/abuse.sh`, which starts the release api-server (production defaults: no limit lifted)
//! and fake-stripe against a scratch database.
//!
//! For each attack it reports the api-server's peak RSS and CPU, the legitimate clients'
//! latency against the quiet baseline measured first in the same run, connections the server
//! refused (its own metric), rows written by anyone but the legitimate clients, database
//! transactions, and how long until a new connection was served after the attacker let go.
//! It judges each attack against its goals (docs/security.md) and exits 1 if one is missed.
//!
//! Last, with the legitimate clients paused, it runs each unauthenticated attack that speaks
//! gRPC alone and counts the database transactions it caused (`footprint`).
//!
//! Beside the 16 legitimate clients runs a rider-facing backend (`backend`): 10,000
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
    /// Leave the backend out: only the 16 legitimate clients beside the attacks.
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
    let (target, tokens, legitimate_ids) = set_up(&args, &pool, &run).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let phases = Arc::new(Phases::default());
    let campaign = Campaign {
        sampler: Sampler::spawn(args.server_pid, Arc::clone(&stop)),
        http: reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(5))
            .build()?,
        args,
        run,
        pool,
        legitimate_ids,
        target,
        phases,
    };
    let (args, pool, phases) = (&campaign.args, &campaign.pool, &campaign.phases);
    if observe::analyze_if_no_autovacuum(pool.clone(), Arc::clone(phases), Arc::clone(&stop))
        .await?
    {
        println!("abuse: the server runs without autovacuum; ANALYZE every 10 s stands in for it");
    }
    let clients = traffic::spawn_legitimate(args.target, tokens, phases, &stop)?;
    // Warm-up, not measured: connections, prepared statements, the first plans.
    phases.begin();
    tokio::time::sleep(WARM_UP).await;

    let mut references = Vec::new();
    if let Some(reference) = campaign.reference_run("reference-start").await? {
        references.push(reference);
    }
    let (baseline, backend_alone) = campaign.quiet_baseline(references.first()).await?;
    let mut results = Vec::new();
    for attack in args.attacks() {
        let result = campaign.attack(attack).await?;
        println!("{}", result.line(&baseline));
        results.push(result);
        tokio::time::sleep(SETTLE).await;
    }
    if let Some(reference) = campaign.reference_run("reference-end").await? {
        references.push(reference);
    }
    let footprints =
        footprint::measure(pool, &campaign.legitimate_ids, phases, &campaign.target).await?;
    stop.store(true, Ordering::SeqCst);
    let _ = tokio::task::spawn_blocking(move || clients.join()).await;
    let verdict = report::print(&baseline, &results, RECOVERY_GOAL)
        & report::print_backend(backend_alone.as_ref(), &results, &references)
        & footprint::print(&footprints);
    if let Some(path) = &args.json_out {
        let json = serde_json::json!({
            "run": campaign.run,
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

impl Args {
    /// The attacks `--only` names, or every one.
    fn attacks(&self) -> Vec<Attack> {
        if self.only.is_empty() {
            Attack::ALL.to_vec()
        } else {
            self.only.clone()
        }
    }
}

/// The legitimate users (their tokens and ids) and the attackers, and the target every attack
/// aims at, with a first ride for the recovery probe.
async fn set_up(
    args: &Args,
    pool: &schema::Pool,
    run: &str,
) -> anyhow::Result<(Target, Vec<String>, Vec<i64>)> {
    let mut legitimate = Vec::new();
    for i in 0..args.clients {
        let (user, token) = api_server::auth::create_user(
            pool,
            &format!("abuse-{run}-{i}@abuse.rocketrides.test"),
            &format!("cus_abuse_{run}_{i}"),
            "pm_card_visa",
        )
        .await
        .with_context(|| format!("creating legitimate user {i}"))?;
        legitimate.push((user.id, token));
    }
    let tester_token = attacker(pool, run, "tester", "pm_card_chargeDeclined").await?;
    let flood_token = attacker(pool, run, "flood", "pm_card_visa").await?;
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
    Ok((target, tokens, legitimate_ids))
}

/// What every step of a campaign shares.
struct Campaign {
    args: Args,
    run: String,
    pool: schema::Pool,
    legitimate_ids: Vec<i64>,
    target: Target,
    phases: Arc<Phases>,
    sampler: Arc<Sampler>,
    http: reqwest::Client,
}

impl Campaign {
    fn backend_on(&self) -> bool {
        !self.args.no_backend
    }

    /// A phase's figures, from `from` to now, with what the database did meanwhile.
    fn window(&self, index: usize, from: Instant, db: Database) -> Window {
        Window::new(&self.phases, &self.sampler, index, from, db)
    }

    /// What the legitimate users wrote since `before`.
    async fn written_since(&self, before: &Database) -> anyhow::Result<Database> {
        Ok(Database::read(&self.pool, &self.legitimate_ids)
            .await?
            .since(before))
    }

    /// The backend's riders for one phase, `None` without the backend.
    async fn riders(&self, label: &str) -> anyhow::Result<Option<Vec<String>>> {
        match self.backend_on() {
            true => Ok(Some(backend::riders(&self.pool, &self.run, label).await?)),
            false => Ok(None),
        }
    }

    /// The backend against the reference server with every defence lifted, when one is given.
    async fn reference_run(&self, label: &str) -> anyhow::Result<Option<backend::BackendRun>> {
        let (Some(reference), true) = (self.args.reference_target, self.backend_on()) else {
            return Ok(None);
        };
        self.phases.begin();
        let secs = Duration::from_secs(self.args.quiet_secs);
        Ok(Some(
            backend::reference_run(&self.pool, &self.run, label, reference, secs).await?,
        ))
    }

    /// The quiet baseline: the legitimate clients (and the backend) with no attack.
    async fn quiet_baseline(
        &self,
        reference: Option<&backend::BackendRun>,
    ) -> anyhow::Result<(Window, Option<backend::BackendRun>)> {
        let alone_riders = self.riders("alone").await?;
        println!(
            "abuse: run {}, {} legitimate clients{}; quiet baseline for {} s",
            self.run,
            self.args.clients,
            if self.backend_on() {
                " and the backend"
            } else {
                ""
            },
            self.args.quiet_secs
        );
        let db = Database::read(&self.pool, &self.legitimate_ids).await?;
        let (quiet, from) = (self.phases.begin(), Instant::now());
        let running = match alone_riders {
            Some(riders) => Some(backend::start(self.args.target, riders).await?),
            None => None,
        };
        tokio::time::sleep(Duration::from_secs(self.args.quiet_secs)).await;
        let backend_alone = match running {
            Some(running) => Some(running.finish().await?),
            None => None,
        };
        let baseline = self.window(quiet, from, self.written_since(&db).await?);
        if let Some(alone) = &backend_alone {
            println!(
                "abuse: backend at the defaults, alone: {}",
                alone.cells(reference)
            );
        }
        Ok((baseline, backend_alone))
    }

    /// One attack beside the legitimate traffic (and the backend), then the time until a probe
    /// is served again; its figures, the attacker's and the backend's.
    async fn attack(&self, attack: Attack) -> anyhow::Result<AttackResult> {
        let riders = self.riders(attack.name()).await?;
        println!("abuse: {} ...", attack.name());
        let metrics = self.args.metrics;
        let refused_before = observe::refused_connections(&self.http, metrics).await?;
        let db = Database::read(&self.pool, &self.legitimate_ids).await?;
        let (index, from) = (self.phases.begin(), Instant::now());
        let running = match riders {
            Some(riders) => Some(backend::start(self.args.target, riders).await?),
            None => None,
        };
        let attacker = attack
            .run(&self.target)
            .await
            .with_context(|| format!("attack {}", attack.name()));
        let backend_seen = match running {
            Some(running) => Some(running.finish().await?),
            None => None,
        };
        let during = self.window(index, from, self.written_since(&db).await?);
        let attacker = attacker?;
        // The recovery and settling time is a phase of its own, kept out of the attack's figures.
        self.phases.begin();
        let target = &self.target;
        let recovery = time_to_serve(
            target.addr,
            &target.probe_token,
            target.probe_ride,
            Duration::from_secs(30),
        )
        .await;
        // Writes finish and statistics are flushed within a second.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let written = self.written_since(&db).await?;
        let refused_after = observe::refused_connections(&self.http, metrics).await?;
        Ok(AttackResult::new(
            attack,
            during,
            written,
            report::difference(&refused_before, &refused_after),
            recovery,
            attacker,
            backend_seen,
        ))
    }
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
