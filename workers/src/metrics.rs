//! The fleet's OpenTelemetry instruments (a no-op until `telemetry::Telemetry::init` installs a
//! provider). Counters are recorded where each worker counts its work, so a loop and a `--once`
//! pass report the same way; gauges are refreshed after each pass.

use std::sync::LazyLock;

use diesel::{
    QueryableByName,
    sql_types::{BigInt, Double},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use opentelemetry::metrics::{Counter, Gauge};
use telemetry::attr;

struct Instruments {
    enqueued: Counter<u64>,
    backlog: Gauge<u64>,
    backlog_oldest_age: Gauge<f64>,
    set_aside: Gauge<u64>,
    parked: Gauge<u64>,
    receipts: Counter<u64>,
    jobs: Counter<u64>,
    completer: Counter<u64>,
    needing_attention: Gauge<u64>,
    reaped: Counter<u64>,
    findings: Gauge<u64>,
}

static INSTRUMENTS: LazyLock<Instruments> = LazyLock::new(|| {
    let meter = telemetry::meter("rides-workers");
    Instruments {
        enqueued: meter
            .u64_counter("rides.enqueuer.messages")
            .with_description("Staged jobs handled by the enqueuer, by outcome")
            .build(),
        backlog: meter
            .u64_gauge("rides.staged_jobs.backlog")
            .with_description("Staged jobs not yet moved to RabbitMQ")
            .build(),
        backlog_oldest_age: meter
            .f64_gauge("rides.staged_jobs.oldest_age")
            .with_unit("s")
            .with_description("Age of the oldest staged job that is neither set aside nor parked")
            .build(),
        set_aside: meter
            .u64_gauge("rides.staged_jobs.set_aside")
            .with_description("Staged jobs the broker returned or refused, waiting out a back-off")
            .build(),
        parked: meter
            .u64_gauge("rides.staged_jobs.parked")
            .with_description("Staged jobs the enqueuer gave up on, waiting for a human")
            .build(),
        receipts: meter
            .u64_counter("rides.receipts.messages")
            .with_description("Receipt messages handled, by outcome")
            .build(),
        jobs: meter
            .u64_counter("rides.jobs.messages")
            .with_description("Job deliveries settled by a consumer, by job and settlement")
            .build(),
        completer: meter
            .u64_counter("rides.completer.keys")
            .with_description("Abandoned keys the completer handled, by outcome")
            .build(),
        needing_attention: meter
            .u64_gauge("rides.keys_needing_attention")
            .with_description("Unresolved keys waiting for a human")
            .build(),
        reaped: meter
            .u64_counter("rides.reaper.keys")
            .with_description("Expired keys the reaper handled, by outcome")
            .build(),
        findings: meter
            .u64_gauge("rides.reconciler.findings")
            .with_description("Open reconciliation findings (provider and rides disagree), by kind")
            .build(),
    }
});

/// The counters of what each worker handled, by outcome. Each worker counts its own summary
/// (`record` beside its `*Summary`), so this module knows none of the workers' types.
#[derive(Clone, Copy, Debug)]
pub enum Handled {
    /// `rides.enqueuer.messages`
    Enqueued,
    /// `rides.receipts.messages`
    Receipts,
    /// `rides.completer.keys`
    Completer,
    /// `rides.reaper.keys`
    Reaped,
}

/// Adds `count` to `counter` for `outcome` (nothing when 0).
pub fn count(counter: Handled, outcome: &'static str, count: u64) {
    let counter = match counter {
        Handled::Enqueued => &INSTRUMENTS.enqueued,
        Handled::Receipts => &INSTRUMENTS.receipts,
        Handled::Completer => &INSTRUMENTS.completer,
        Handled::Reaped => &INSTRUMENTS.reaped,
    };
    if count > 0 {
        counter.add(count, &[attr("outcome", outcome)]);
    }
}

/// Counts one delivery of `job` settled as `settlement` (`ack`, `dead_letter`, `retry`): the
/// generic consumer's counter, the same for every job type.
pub fn count_settled(job: &'static str, settlement: &'static str) {
    INSTRUMENTS
        .jobs
        .add(1, &[attr("job", job), attr("settlement", settlement)]);
}

#[derive(QueryableByName)]
struct Backlog {
    #[diesel(sql_type = BigInt)]
    jobs: i64,
    #[diesel(sql_type = Double)]
    oldest_age_secs: f64,
    #[diesel(sql_type = BigInt)]
    set_aside: i64,
    #[diesel(sql_type = BigInt)]
    parked: i64,
}

/// Refreshes the staged-job backlog gauges. A failure only leaves the last values in place.
/// The oldest age leaves out set-aside and parked jobs, which have their own gauges: one parked
/// job must not keep the backlog-age alert firing, nor hide a stalled drain behind it.
pub async fn observe_backlog(conn: &mut AsyncPgConnection) {
    let backlog = diesel::sql_query(
        "SELECT count(*) AS jobs, \
         COALESCE(EXTRACT(EPOCH FROM now() - min(created_at) \
             FILTER (WHERE next_attempt_at IS NULL AND parked_at IS NULL)), 0)::float8 \
             AS oldest_age_secs, \
         count(*) FILTER (WHERE next_attempt_at IS NOT NULL AND parked_at IS NULL) AS set_aside, \
         count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked \
         FROM staged_jobs",
    )
    .get_result::<Backlog>(conn)
    .await;
    if let Ok(backlog) = backlog {
        INSTRUMENTS
            .backlog
            .record(u64::try_from(backlog.jobs).unwrap_or(0), &[]);
        INSTRUMENTS
            .backlog_oldest_age
            .record(backlog.oldest_age_secs, &[]);
        INSTRUMENTS
            .set_aside
            .record(u64::try_from(backlog.set_aside).unwrap_or(0), &[]);
        INSTRUMENTS
            .parked
            .record(u64::try_from(backlog.parked).unwrap_or(0), &[]);
    }
}

#[derive(QueryableByName)]
struct Unresolved {
    #[diesel(sql_type = BigInt)]
    keys: i64,
}

/// Refreshes the keys-needing-a-human gauge.
pub async fn observe_needing_attention(conn: &mut AsyncPgConnection) {
    let unresolved = diesel::sql_query(
        "SELECT count(*) AS keys FROM keys_needing_attention WHERE resolved_at IS NULL",
    )
    .get_result::<Unresolved>(conn)
    .await;
    if let Ok(unresolved) = unresolved {
        INSTRUMENTS
            .needing_attention
            .record(u64::try_from(unresolved.keys).unwrap_or(0), &[]);
    }
}

#[derive(QueryableByName)]
struct OpenFindings {
    #[diesel(sql_type = diesel::sql_types::Text)]
    kind: String,
    #[diesel(sql_type = BigInt)]
    findings: i64,
}

/// Refreshes the open-findings gauge, one series per kind (0 for a kind with none, so an alert
/// on it clears once the last one is resolved).
pub async fn observe_findings(conn: &mut AsyncPgConnection) {
    let open = diesel::sql_query(
        "SELECT kind, count(*) AS findings FROM reconciliation_findings \
         WHERE resolved_at IS NULL GROUP BY kind",
    )
    .load::<OpenFindings>(conn)
    .await;
    if let Ok(open) = open {
        for kind in schema::FindingKind::ALL {
            let count = open
                .iter()
                .find(|row| row.kind == kind.as_str())
                .map_or(0, |row| u64::try_from(row.findings).unwrap_or(0));
            INSTRUMENTS
                .findings
                .record(count, &[attr("kind", kind.as_str())]);
        }
    }
}
