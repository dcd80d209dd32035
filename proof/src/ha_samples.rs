//! What is sampled while `--ha` runs so that a long outage after a fault can be explained, kept
//! by [`crate::counters::Timeline`] and summed by the report over each long outage:
//!
//! - [`primary_sessions`]: what the primary's sessions were waiting on, twice a second: commits
//!   waiting for the synchronous standby (`IPC/SyncRep`), row locks (`Lock/transactionid`), or no
//!   primary reachable at all.
//! - [`own_clock`]: how late the campaign's own runtime wakes up: clients that are not scheduled
//!   see an outage the servers never caused.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use diesel::{
    QueryableByName,
    sql_types::{BigInt, Text},
};
use diesel_async::AsyncPgConnection;

use crate::counters::Timeline;

const EVERY: Duration = Duration::from_millis(500);
/// How often [`own_clock`] looks at the time.
const TICK: Duration = Duration::from_millis(100);
/// A sample that takes longer is worth less than the next one: a failover is under way.
const PATIENCE: Duration = Duration::from_secs(1);

/// The label of a sample with no primary to ask.
const UNREACHABLE: &str = "no primary reachable";

/// The client sessions of the campaign's database that are busy, by state and wait event:
/// `active:IPC/SyncRep`, `active:-` (running), `idle in transaction:Client/ClientRead`.
const BUSY_SESSIONS: &str = "SELECT state || ':' || coalesce(wait_event_type || '/' || wait_event, '-') AS label, \
     count(*) AS n \
     FROM pg_stat_activity \
     WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() \
       AND state IN ('active', 'idle in transaction') \
     GROUP BY 1";

#[derive(QueryableByName)]
struct BusyRow {
    #[diesel(sql_type = Text)]
    label: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Samples the primary behind `admin_url` (a multi-host URL that picks the read-write node)
/// until `stop`, reconnecting after a failover.
pub(crate) async fn primary_sessions(
    admin_url: String,
    timeline: Arc<Timeline>,
    stop: Arc<AtomicBool>,
) {
    let mut conn: Option<AsyncPgConnection> = None;
    while !stop.load(Ordering::Relaxed) {
        let next = Instant::now() + EVERY;
        let busy = match tokio::time::timeout(PATIENCE, sample_once(&admin_url, &mut conn)).await {
            Ok(Ok(busy)) => busy,
            Ok(Err(_)) | Err(_) => {
                conn = None;
                BTreeMap::from([(UNREACHABLE.to_owned(), 1)])
            }
        };
        timeline.db_sample(busy);
        tokio::time::sleep_until(next.into()).await;
    }
}

async fn sample_once(
    admin_url: &str,
    conn: &mut Option<AsyncPgConnection>,
) -> anyhow::Result<BTreeMap<String, u64>> {
    if conn.is_none() {
        *conn = Some(schema::connect(admin_url).await?);
    }
    let Some(c) = conn.as_mut() else {
        anyhow::bail!("no connection");
    };
    // In scope here only: its blanket `load` would shadow `AtomicBool::load` above.
    use diesel_async::RunQueryDsl;
    let rows: Vec<BusyRow> = diesel::sql_query(BUSY_SESSIONS).load(c).await?;
    Ok(rows
        .into_iter()
        .map(|row| (row.label, u64::try_from(row.n).unwrap_or(0)))
        .collect())
}

/// Wakes every [`TICK`] until `stop` and records how much later than asked it woke.
pub(crate) async fn own_clock(timeline: Arc<Timeline>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let due = Instant::now() + TICK;
        tokio::time::sleep_until(due.into()).await;
        timeline.own_lateness(Instant::now().saturating_duration_since(due));
    }
}
