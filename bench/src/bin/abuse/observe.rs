//! What the campaign reads off the server side: the api-server's memory and CPU (sampled from
//! `/proc` every 100 ms), its connection refusals (its own `/metrics`), and the database's
//! transactions and the rows written by anyone who is not a legitimate client.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bench::procfs::{TICKS_PER_SEC, cpu_ticks, machine_ticks, vm_rss_kb};
use diesel::{
    QueryableByName,
    sql_types::{Array, BigInt},
};
use serde::Serialize;

use crate::traffic::Phases;

const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// One reading every [`SAMPLE_EVERY`].
#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    /// The api-server's VmRSS, kB.
    rss_kb: u64,
    /// CPU ticks of the api-server, of this process (the attackers and the legitimate
    /// clients), and of the whole machine (busy, total).
    server: u64,
    campaign: u64,
    machine: (u64, u64),
}

#[derive(Default)]
pub struct Sampler {
    samples: Mutex<Vec<Sample>>,
}

/// The api-server's resource use over a window.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct Usage {
    pub peak_rss_mib: f64,
    /// CPU time over wall time: 1.0 is one core busy.
    pub cpu_mean_cores: f64,
    /// The busiest second of the window.
    pub cpu_peak_cores: f64,
    /// This process's CPU: the attacker share of the 2 cores the api-server shares with it.
    pub campaign_cores: f64,
    /// How busy the whole machine was (1.0: every core).
    pub machine_busy: f64,
}

impl Sampler {
    pub fn spawn(pid: u32, stop: Arc<AtomicBool>) -> Arc<Sampler> {
        let sampler = Arc::new(Sampler::default());
        let writer = Arc::clone(&sampler);
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if let (Some(rss_kb), Some(machine)) = (vm_rss_kb(pid), machine_ticks()) {
                    writer.locked().push(Sample {
                        at: Instant::now(),
                        rss_kb,
                        server: cpu_ticks(&[pid]),
                        campaign: cpu_ticks(&[std::process::id()]),
                        machine,
                    });
                }
                tokio::time::sleep(SAMPLE_EVERY).await;
            }
        });
        sampler
    }

    pub fn window(&self, from: Instant, to: Instant) -> Usage {
        let samples = self.locked();
        let inside: Vec<Sample> = samples
            .iter()
            .copied()
            .filter(|s| (from..=to).contains(&s.at))
            .collect();
        let (Some(first), Some(last)) = (inside.first(), inside.last()) else {
            return Usage::default();
        };
        let per_sec = |a: &Sample, b: &Sample, ticks: fn(&Sample) -> u64| {
            let secs = b.at.saturating_duration_since(a.at).as_secs_f64();
            let used = ticks(b).saturating_sub(ticks(a)) as f64 / TICKS_PER_SEC as f64;
            if secs > 0.0 { used / secs } else { 0.0 }
        };
        let cores = |a: &Sample, b: &Sample| per_sec(a, b, |s| s.server);
        // Tick counts move in hundredths of a second, so the peak is taken over whole seconds.
        let step = (1000 / SAMPLE_EVERY.as_millis()) as usize;
        let cpu_peak_cores = inside
            .windows(step + 1)
            .map(|w| cores(&w[0], &w[step]))
            .fold(0.0, f64::max);
        Usage {
            peak_rss_mib: inside.iter().map(|s| s.rss_kb).max().unwrap_or(0) as f64 / 1024.0,
            cpu_mean_cores: cores(first, last),
            cpu_peak_cores,
            campaign_cores: per_sec(first, last, |s| s.campaign),
            machine_busy: (last.machine.0.saturating_sub(first.machine.0)) as f64
                / (last.machine.1.saturating_sub(first.machine.1)).max(1) as f64,
        }
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, Vec<Sample>> {
        self.samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The api-server's `rides.grpc.connections.refused`, by label set, from its `/metrics`.
pub async fn refused_connections(
    http: &reqwest::Client,
    metrics: SocketAddr,
) -> anyhow::Result<BTreeMap<String, f64>> {
    let text = http
        .get(format!("http://{metrics}/metrics"))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|line| line.starts_with("rides_grpc_connections_refused"))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let labels = series
                .split_once('{')
                .map_or("", |(_, l)| l.trim_end_matches('}'));
            Some((labels.to_owned(), value.parse().ok()?))
        })
        .collect())
}

/// Rows owned by users who are neither legitimate clients nor the backend's riders (the
/// attackers, authenticated or not), and the database's transaction count.
#[derive(Debug, Default, Clone, Copy, Serialize, QueryableByName)]
pub struct Database {
    #[diesel(sql_type = BigInt)]
    pub attacker_keys: i64,
    #[diesel(sql_type = BigInt)]
    pub attacker_rides: i64,
    #[diesel(sql_type = BigInt)]
    pub attacker_audit_records: i64,
    #[diesel(sql_type = BigInt)]
    pub transactions: i64,
}

impl Database {
    pub async fn read(pool: &schema::Pool, legitimate: &[i64]) -> anyhow::Result<Database> {
        // In scope here only: its `load` and `first` would shadow AtomicBool's and Vec's.
        use diesel_async::RunQueryDsl;
        let mut conn = pool.get().await?;
        // pg_stat_database is flushed by each backend at most once a second.
        // The backend's riders (`backend`) are legitimate too, found by their mail domain: each
        // run creates 10,000 of them, too many to pass as ids. The other users are a few dozen.
        Ok(diesel::sql_query(
            "WITH others AS (SELECT id FROM users WHERE email NOT LIKE $2 AND id <> ALL($1))
             SELECT (SELECT count(*) FROM idempotency_keys
                      WHERE user_id IN (SELECT id FROM others)) AS attacker_keys,
                    (SELECT count(*) FROM rides
                      WHERE user_id IN (SELECT id FROM others)) AS attacker_rides,
                    (SELECT count(*) FROM audit_records
                      WHERE user_id IN (SELECT id FROM others)) AS attacker_audit_records,
                    (SELECT xact_commit + xact_rollback FROM pg_stat_database
                      WHERE datname = current_database()) AS transactions",
        )
        .bind::<Array<BigInt>, _>(legitimate)
        .bind::<diesel::sql_types::Text, _>(format!("%@{}", crate::backend::RIDER_DOMAIN))
        .get_result(&mut conn)
        .await?)
    }

    /// What was added since `before`.
    pub fn since(&self, before: &Database) -> Database {
        Database {
            attacker_keys: self.attacker_keys - before.attacker_keys,
            attacker_rides: self.attacker_rides - before.attacker_rides,
            attacker_audit_records: self.attacker_audit_records - before.attacker_audit_records,
            transactions: self.transactions - before.transactions,
        }
    }
}

/// Stands in for autovacuum's ANALYZE where the server runs without autovacuum (this machine's
/// PostgreSQL does): the api-server's prepared statements are planned from the statistics, and
/// on a scratch database that is never analysed they keep the plans made for empty tables,
/// sequential scans that grow with every ride. Production's autovacuum re-analyses as tables
/// grow and PostgreSQL then re-plans those statements.
/// Paused with the legitimate clients: nothing is written then, and the footprint windows must
/// not count its transactions.
pub async fn analyze_if_no_autovacuum(
    pool: schema::Pool,
    phases: Arc<Phases>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<bool> {
    use diesel_async::RunQueryDsl;
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        autovacuum: String,
    }
    let setting: Setting = diesel::sql_query("SELECT current_setting('autovacuum') AS autovacuum")
        .get_result(&mut pool.get().await?)
        .await?;
    if setting.autovacuum == "on" {
        return Ok(false);
    }
    tokio::spawn(async move {
        while !AtomicBool::load(&stop, Ordering::SeqCst) {
            if !phases.paused()
                && let Ok(mut conn) = pool.get().await
            {
                let _ = diesel::sql_query(
                    "ANALYZE idempotency_keys, rides, audit_records, staged_jobs, users",
                )
                .execute(&mut conn)
                .await;
            }
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
    });
    Ok(true)
}
