//! `proof`: a crash-and-fault campaign against the real Rocket Rides processes on loopback.
//!
//! It starts its own PostgreSQL cluster and RabbitMQ node ([`services`]), fake-stripe, two
//! api-servers (the second with a pool of one connection, to exhaust it), a mail sink, the
//! enqueuer and the receipt worker as separate child processes (plus `completer --once` /
//! `reaper --once` passes), and drives CreateRide with concurrent retrying clients spread over
//! both api-servers. Meanwhile it SIGKILLs the api-servers (at random, and at every crash point
//! of `api_server::fault`) and the workers, stalls an api-server past the lock timeout, restarts
//! PostgreSQL and RabbitMQ, and injects provider faults. Then it drains the system and checks
//! exactly-once charging and receipting against PostgreSQL, fake-stripe's ledger and the mail
//! sink's directory. Any violation is printed with the offending key and makes the process exit
//! non-zero. See docs/reliability.md.
//!
//! One module per step of the campaign, each handing the next a typed result:
//!
//! - [`args`]: the command line.
//! - [`setup`]: the run's id, seed and directories ([`setup::Plan`]), its private servers, the
//!   environment of every child ([`setup::Wiring`]) and a fresh database.
//! - [`services`]: the private PostgreSQL and RabbitMQ, which the faults restart.
//! - [`processes`]: the child processes ([`processes::Children`]), their crash points and the
//!   supervisor that restarts whatever died by itself.
//! - [`clients`]: the retrying clients, whose [`clients::KeyRecord`]s say what each key's
//!   client finally saw.
//! - [`faults`]: the fault tasks, while traffic runs.
//! - [`maintenance`]: the completer and reaper passes, and the drains after traffic.
//! - [`money`], [`money_rider`], [`other_product`], [`money_checks`]: the money campaign (with
//!   `--money`): another product's look-alike charges, the reconciler refunding while traffic
//!   runs, riders retrying keys the completer gave up, and its invariants.
//! - [`replays`]: every finished key sent again, to compare with its first answer.
//! - [`evidence`]: the database rows, the ledger and the mail, read once drained.
//! - [`reconciliation`]: a reconciler pass over the whole run, and the findings it recorded.
//! - [`invariants`]: what the clients saw, checked against the evidence.
//! - [`holder_deaths`]: what each api-server's death cost the keys it held.
//! - [`report`]: the progress line and the report.
//! - [`counters`]: the tallies the steps keep while they run, for the report.
//! - [`ha_samples`]: with `--ha`, what the primary's sessions wait on and how late the
//!   campaign's own runtime runs, to explain an outage.
//!
//! `main` and the flow from one step to the next stay here, because the order is part of what
//! the campaign proves: faults stop before the drains, the replays run while the api-servers
//! still do, and every child is stopped before the evidence is judged.

mod args;
mod clients;
mod counters;
mod evidence;
mod faults;
mod ha_samples;
mod holder_deaths;
mod invariants;
mod load_balancer;
mod maintenance;
mod money;
mod money_checks;
mod money_rider;
mod other_product;
mod outages;
mod processes;
mod reconciliation;
mod replays;
mod report;
mod services;
mod setup;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use clap::Parser;

use args::Args;
use clients::{Traffic, Window};
use counters::Tallies;
use faults::Faults;
use invariants::{Facts, Violations};
use maintenance::Maintainer;
use processes::{Children, Supervisor};
use report::Report;
use services::Services;
use setup::{DbGuard, Plan, Wiring};

#[tokio::main]
async fn main() {
    let args = Args::parse().for_rolling();
    let code = tokio::select! {
        result = campaign(args) => match result {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(error) => {
                eprintln!("proof: error: {error:#}");
                2
            }
        },
        () = interrupted() => {
            eprintln!("proof: interrupted; children are killed on drop");
            130
        }
    };
    // The private servers are daemons, not children: stop them explicitly.
    if code == 130
        && let Some(services) = RUNNING_SERVICES.get()
    {
        services.stop(false).await;
    }
    // Dropping the campaign future above killed every child (kill_on_drop).
    std::process::exit(code);
}

/// Ctrl-C or SIGTERM.
async fn interrupted() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The private servers of this run, for the interrupt path.
static RUNNING_SERVICES: std::sync::OnceLock<Arc<Services>> = std::sync::OnceLock::new();

async fn campaign(args: Args) -> anyhow::Result<bool> {
    let plan = Plan::new(&args)?;
    setup::check_ports_free(&args).await?;
    let services = setup::start_services(&args, &plan).await?;
    let wiring = Wiring::new(&args, &plan, &services)?;
    println!(
        "proof: run {}, seed {}, {}s of traffic, {} clients, database {}, out {}",
        plan.run_id,
        plan.seed,
        plan.duration.as_secs(),
        args.clients,
        wiring.db_name,
        plan.out_dir.display()
    );
    let services = Arc::new(services);
    let _ = RUNNING_SERVICES.set(Arc::clone(&services));
    // `--rolling-from`: the schema starts as the older build left it; this build's migrations
    // are applied under traffic before the first rollout (faults::rolling_deploys).
    let migrated = setup::migrate(
        &setup::first_binary(&args, &plan, "api-server"),
        &wiring.env,
    )
    .await;
    if migrated.is_err() {
        services.stop(args.keep).await;
    }
    migrated?;
    let guard = DbGuard::new(&wiring, args.keep);
    let result = run(&args, &plan, &wiring, Arc::clone(&services)).await;
    if services.pg.is_none() && services.ha.is_none() {
        guard.cleanup().await;
    }
    services.stop(args.keep).await;
    result
}

/// From the first child started to the report.
async fn run(
    args: &Args,
    plan: &Plan,
    wiring: &Wiring,
    services: Arc<Services>,
) -> anyhow::Result<bool> {
    let mut children = Children::start(args, plan, wiring).await?;
    let users = clients::create_users(args, plan, wiring).await?;
    let tallies = Tallies::default();
    let http = http_client()?;

    // Traffic and faults.
    let window = Window::from_now(plan.duration);
    let traffic = Traffic::start(args, plan, &users, &tallies, window)?;
    let supervisor = Supervisor::start(&children, &tallies.faults);
    let faults = Faults::start(args, plan, wiring, &children, &services, &tallies, &http);
    let maintainer = Maintainer::start(plan, wiring, &tallies.maintenance);
    let money = money::Money::start(args, plan, wiring, &http, window).await?;
    let progress = report::progress(
        faults.stopped(),
        Arc::clone(&tallies.requests),
        Arc::clone(&tallies.faults),
        window.start,
    );
    tokio::time::sleep_until(window.end.into()).await;
    let faulted = faults
        .stop()
        .await
        .and_then(|()| ha_faults_ran(args, plan, &tallies));
    if let Err(error) = faulted {
        // The run cannot be judged; leave no child behind on the run's ports.
        supervisor.stop().await;
        children.kill_all().await;
        return Err(error);
    }
    let _ = progress.await;
    faults::clear_provider_faults(&http, &wiring.stripe_base).await;
    let secs = window.start.elapsed().as_secs();
    println!("proof: traffic stopped after {secs}s; faults off; waiting for clients");
    children.disarm(&tallies.faults).await?;
    let records = traffic.finish().await?;
    let money = match money {
        Some(money) => Some(money.finish(plan, wiring).await?),
        None => None,
    };
    maintainer.stop().await;
    let clients_done = Instant::now();

    let gathering = Gathering {
        args,
        plan,
        wiring,
        tallies: &tallies,
        http: &http,
    };
    let with_money = money.is_some();
    let gathered = gathering
        .gather(clients_done, &records, &users, with_money)
        .await?;
    // Stop every child before judging (the database and ledger are read).
    supervisor.stop().await;
    children.kill_all().await;
    gathering.judge(&children, &records, &users, gathered, money)
}

fn http_client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()
}

/// What judging a run reads, gathered while the children still run.
struct Gathered {
    drain: maintenance::Drain,
    replays: replays::Replays,
    evidence: evidence::Evidence,
    money_evidence: Option<money_checks::MoneyEvidence>,
    violations: Violations,
}

/// The run's context for [`Gathering::gather`].
struct Gathering<'a> {
    args: &'a Args,
    plan: &'a Plan,
    wiring: &'a Wiring,
    tallies: &'a Tallies,
    http: &'a reqwest::Client,
}

impl Gathering<'_> {
    /// Drains the work the traffic left (the completer's and the enqueuer's), replays every
    /// answered key, and reads the evidence (and the money campaign's, `with_money`).
    async fn gather(
        &self,
        clients_done: Instant,
        records: &[clients::KeyRecord],
        users: &[clients::User],
        with_money: bool,
    ) -> anyhow::Result<Gathered> {
        let (args, plan, wiring) = (self.args, self.plan, self.wiring);
        let mut conn = schema::connect(&wiring.database_url).await?;
        let drain = maintenance::drain(
            args,
            plan,
            wiring,
            &mut conn,
            &self.tallies.maintenance,
            clients_done,
        )
        .await?;
        let keys = evidence::load_keys(&mut conn).await?;
        let mut violations = Violations::default();
        let replays = replays::replay(
            args,
            &wiring.grpc_addr,
            records,
            &keys,
            users,
            &mut violations,
        )
        .await?;
        let evidence = evidence::collect(&mut conn, keys, self.http, plan, wiring).await?;
        let money_evidence = match with_money {
            true => Some(money_checks::collect(&mut conn, self.http, wiring).await?),
            false => None,
        };
        Ok(Gathered {
            drain,
            replays,
            evidence,
            money_evidence,
            violations,
        })
    }
}

impl Gathering<'_> {
    /// Judges the run from what was gathered (and the money campaign's riders, `money`) and
    /// writes its report; whether every invariant held.
    fn judge(
        &self,
        children: &Children,
        records: &[clients::KeyRecord],
        users: &[clients::User],
        gathered: Gathered,
        money: Option<(Vec<money::MoneyKey>, Arc<counters::Counters>)>,
    ) -> anyhow::Result<bool> {
        let facts = Facts {
            records,
            users,
            evidence: &gathered.evidence,
            replays: &gathered.replays,
        };
        let (args, tallies) = (self.args, self.tallies);
        let mut verdict = invariants::judge(
            args,
            &facts,
            &children.arming,
            &tallies.faults,
            gathered.violations,
        );
        invariants::rolling::check(
            args,
            records,
            &tallies.attempts.snapshot(),
            &tallies.faults.snapshot(),
            &self.plan.log_dir,
            &mut verdict.violations,
        );
        let outages = outages::spread(&outages::per_fault(&tallies.timeline));
        invariants::failover::check(args, &outages, &mut verdict.violations);
        invariants::failover::check_live_replays(
            args,
            &tallies.live_replays,
            &mut verdict.violations,
        );
        let money = money_checks::judge_and_report(
            &gathered.evidence,
            money.as_ref(),
            gathered.money_evidence.as_ref(),
            &mut verdict.violations,
        );
        report::write_keys(&self.plan.out_dir, records)?;
        let holder_deaths = holder_deaths::measure(&tallies.timeline, &children.arming, !args.lb);
        holder_deaths.write_slowest(&self.plan.out_dir)?;
        Report {
            args,
            plan: self.plan,
            wiring: self.wiring,
            tallies,
            drain: &gathered.drain,
            facts: &facts,
            verdict: &verdict,
            money,
            holder_deaths: &holder_deaths,
        }
        .write()
    }
}

/// `--ha` must have failed the primary over and killed a broker node at least once.
fn ha_faults_ran(args: &Args, plan: &Plan, tallies: &Tallies) -> anyhow::Result<()> {
    if !args.ha {
        return Ok(());
    }
    let events = tallies.timeline.events();
    for kind in ["failover/", "sigkill/rabbitmq"] {
        if !events.iter().any(|event| event.label.starts_with(kind)) {
            anyhow::bail!(
                "--ha: no {kind}… fault ran in {}s of traffic",
                plan.duration.as_secs()
            );
        }
    }
    Ok(())
}
