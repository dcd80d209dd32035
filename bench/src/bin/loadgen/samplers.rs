//! What is sampled while the load runs: the database's wait events, the api-server's RSS, the
//! server-side counters at each end of the measured window.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::task::JoinHandle;

use crate::args::Args;

use anyhow::Context;
use bench::{
    procfs::{cpu_ticks, load_average, machine_ticks, pids_named, vm_rss_kb},
    server_counters::{self, BatchTotals},
};
use diesel::{
    QueryableByName,
    sql_types::{BigInt, Text},
};
use diesel_async::RunQueryDsl;

#[derive(QueryableByName)]
struct WaitRow {
    #[diesel(sql_type = Text)]
    what: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The server-side counters read at each end of the measured window.
pub(crate) struct ServerCounters {
    /// `pg_stat_database.xact_commit` of the database (its statistics lag by up to a second,
    /// a few percent of a 15 s window).
    pub(crate) commits: Option<i64>,
    pub(crate) batches: BTreeMap<String, BatchTotals>,
    /// The api-server's claim statements and waiters' key reads (with --metrics-url).
    pub(crate) claim_statements: Option<f64>,
    pub(crate) wait_polls: Option<f64>,
}

impl ServerCounters {
    pub(crate) async fn read(database_url: &str, metrics_url: Option<&str>) -> Self {
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
    pub(crate) commits: i64,
}

pub(crate) async fn database_commits(url: &str) -> anyhow::Result<i64> {
    let mut conn = schema::connect(url).await?;
    let row: CommitsRow = diesel::sql_query(
        "SELECT xact_commit AS commits FROM pg_stat_database WHERE datname = current_database()",
    )
    .get_result(&mut conn)
    .await?;
    Ok(row.commits)
}

pub(crate) async fn scrape(url: &str) -> anyhow::Result<String> {
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
pub(crate) async fn sample_wait_events(
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

pub(crate) async fn database_backends(url: &str) -> anyhow::Result<Vec<u32>> {
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
pub(crate) async fn sample_rss(pid: u32, stop: Arc<AtomicBool>) -> (u64, u64) {
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

/// The process groups whose CPU time is counted, by name.
type CpuGroups = Vec<(String, Vec<u32>)>;

/// What the window's opening read: the CPU groups (the database's backends listed then), their
/// CPU ticks, the machine's, and the server-side counters.
type WindowStart = (CpuGroups, Vec<u64>, Option<(u64, u64)>, ServerCounters);

/// The samplers of one run, started before the clients.
pub(crate) struct Samplers {
    stop: Arc<AtomicBool>,
    waits: JoinHandle<anyhow::Result<(u64, BTreeMap<String, u64>)>>,
    rss: Option<JoinHandle<(u64, u64)>>,
    window_start: JoinHandle<WindowStart>,
}

/// What the samplers saw over the measured window.
pub(crate) struct Sampled {
    pub(crate) cpu_groups: CpuGroups,
    pub(crate) cpu_before: Vec<u64>,
    pub(crate) cpu_after: Vec<u64>,
    pub(crate) machine_before: Option<(u64, u64)>,
    pub(crate) machine_after: Option<(u64, u64)>,
    pub(crate) counters_before: ServerCounters,
    pub(crate) counters_after: ServerCounters,
    /// Samples taken, and non-idle backends by wait event summed over them.
    pub(crate) wait_samples: (u64, BTreeMap<String, u64>),
    /// The api-server's VmRSS, peak and last (KB).
    pub(crate) rss: Option<(u64, u64)>,
    pub(crate) ended_at_load: String,
}

impl Samplers {
    pub(crate) fn start(args: &Args, measure_from: Instant) -> anyhow::Result<Samplers> {
        let stop = Arc::new(AtomicBool::new(false));
        let waits = tokio::spawn(sample_wait_events(
            args.database_url.clone(),
            Arc::clone(&stop),
        ));
        let rss = args
            .server_pid
            .map(|pid| tokio::spawn(sample_rss(pid, Arc::clone(&stop))));
        let mut cpu_groups: CpuGroups = vec![("loadgen".to_owned(), vec![std::process::id()])];
        if let Some(pid) = args.server_pid {
            cpu_groups.push(("api-server".to_owned(), vec![pid]));
        }
        for spec in &args.cpu_pid {
            let (name, pid) = spec.split_once('=').context("--cpu-pid takes NAME=PID")?;
            cpu_groups.push((name.to_owned(), vec![pid.parse()?]));
        }
        // CPU is counted over the measured window only, and the database's backends are listed
        // when it opens: a freshly started api-server opens its pooled connections during the
        // warm-up, so a list taken before it missed most of them.
        let url = args.database_url.clone();
        let metrics_url = args.metrics_url.clone();
        let window_start = tokio::spawn(async move {
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
        });
        Ok(Samplers {
            stop,
            waits,
            rss,
            window_start,
        })
    }

    /// Stops the samplers at the window's end and reads the closing figures.
    pub(crate) async fn finish(self, args: &Args) -> anyhow::Result<Sampled> {
        self.stop.store(true, Ordering::SeqCst);
        let (cpu_groups, cpu_before, machine_before, counters_before) = self.window_start.await?;
        let cpu_after: Vec<u64> = cpu_groups.iter().map(|(_, pids)| cpu_ticks(pids)).collect();
        let machine_after = machine_ticks();
        let counters_after =
            ServerCounters::read(&args.database_url, args.metrics_url.as_deref()).await;
        let wait_samples = self.waits.await?.unwrap_or_else(|error| {
            eprintln!("wait-event sampling failed: {error:#}");
            (0, BTreeMap::new())
        });
        let rss = match self.rss {
            Some(task) => Some(task.await?),
            None => None,
        };
        Ok(Sampled {
            cpu_groups,
            cpu_before,
            cpu_after,
            machine_before,
            machine_after,
            counters_before,
            counters_after,
            wait_samples,
            rss,
            ended_at_load: load_average(),
        })
    }
}
