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

use crate::{
    completer::CompleteSummary, enqueuer::EnqueueSummary, reaper::ReapSummary,
    receipts::ReceiptSummary,
};

struct Instruments {
    enqueued: Counter<u64>,
    backlog: Gauge<u64>,
    backlog_oldest_age: Gauge<f64>,
    set_aside: Gauge<u64>,
    parked: Gauge<u64>,
    receipts: Counter<u64>,
    completer: Counter<u64>,
    needing_attention: Gauge<u64>,
    reaped: Counter<u64>,
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
    }
});

fn add(counter: &Counter<u64>, outcome: &'static str, count: u64) {
    if count > 0 {
        counter.add(count, &[attr("outcome", outcome)]);
    }
}

pub fn record_enqueue(summary: &EnqueueSummary) {
    let counter = &INSTRUMENTS.enqueued;
    add(counter, "published", summary.published);
    add(counter, "returned", summary.returned);
    add(counter, "nacked", summary.nacked);
    add(counter, "set_aside", summary.set_aside);
    add(counter, "parked", summary.parked);
}

pub fn record_receipts(summary: &ReceiptSummary) {
    let counter = &INSTRUMENTS.receipts;
    add(counter, "sent", summary.sent);
    add(counter, "duplicate", summary.duplicates);
    add(counter, "recovered", summary.recovered);
    add(counter, "unverified_resend", summary.unverified_resends);
    add(counter, "dead_lettered", summary.dead_lettered);
    add(counter, "retried", summary.retried);
}

pub fn record_completer(summary: &CompleteSummary) {
    let counter = &INSTRUMENTS.completer;
    add(counter, "completed", summary.completed);
    add(counter, "declined", summary.declined);
    add(counter, "still_failing", summary.still_failing);
    add(counter, "skipped_in_use", summary.skipped_in_use);
    add(counter, "gave_up", summary.gave_up);
}

pub fn record_reaper(summary: &ReapSummary) {
    let counter = &INSTRUMENTS.reaped;
    add(counter, "deleted", summary.deleted);
    add(counter, "recorded_unfinished", summary.unfinished_recorded);
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
