//! The reaper: deletes idempotency keys older than the TTL, in batches. Rides stay (their
//! `idempotency_key_id` becomes NULL). A key that never finished is first copied into
//! `keys_needing_attention` (reason `reaped_unfinished`) in the same statement that deletes it,
//! so it is never dropped silently. Keys whose lock is still live are left for a later pass:
//! deleting a key under a running attempt would make that attempt fail half-way.

use std::time::Duration;

use diesel::{QueryableByName, sql_types::BigInt};
use diesel_async::RunQueryDsl;
use schema::{Pool, PoolError};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{
    backoff::Backoff,
    config::ReaperConfig,
    metrics::{self, Handled},
    worker_loop::{self, Next, Passes},
};

#[derive(Debug, thiserror::Error)]
pub enum ReapError {
    #[error("no database connection available")]
    Pool(#[from] PoolError),
    #[error("database error")]
    Database(#[from] diesel::result::Error),
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReapSummary {
    pub batches: u64,
    pub deleted: u64,
    /// Unfinished keys recorded in `keys_needing_attention` before deletion.
    pub unfinished_recorded: u64,
}

impl ReapSummary {
    /// Counts this summary in the worker's metric, by outcome.
    pub(crate) fn record(&self) {
        metrics::count(Handled::Reaped, "deleted", self.deleted);
        metrics::count(
            Handled::Reaped,
            "recorded_unfinished",
            self.unfinished_recorded,
        );
    }
}

#[derive(QueryableByName)]
struct BatchCounts {
    #[diesel(sql_type = BigInt)]
    deleted: i64,
    #[diesel(sql_type = BigInt)]
    recorded: i64,
}

/// One batch in one statement (so in one transaction): pick expired keys, record the unfinished
/// ones, delete them all.
const REAP_BATCH: &str = concat!(
    "
WITH doomed AS (
    SELECT id, user_id, idempotency_key, recovery_point, request_params, completer_attempts
    FROM idempotency_keys
    WHERE created_at < now() - make_interval(secs => $1)
      AND ",
    contract::lock_state_sql!("$2", "$4"),
    " <> 'live'
    ORDER BY created_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), recorded AS (
    INSERT INTO keys_needing_attention
        (reason, idempotency_key_id, user_id, idempotency_key, recovery_point, request_params,
         last_error)
    SELECT 'reaped_unfinished', id, user_id, idempotency_key, recovery_point, request_params,
           'unfinished at ' || recovery_point || ' after ' || completer_attempts
               || ' completer attempts'
    FROM doomed
    WHERE recovery_point <> 'finished'
    RETURNING 1
), deleted AS (
    DELETE FROM idempotency_keys k USING doomed d
    WHERE k.id = d.id AND k.user_id = d.user_id RETURNING 1
)
SELECT (SELECT count(*) FROM deleted) AS deleted, (SELECT count(*) FROM recorded) AS recorded"
);

pub struct Reaper {
    pool: Pool,
    config: ReaperConfig,
}

impl Reaper {
    pub fn new(pool: Pool, config: ReaperConfig) -> Reaper {
        Reaper { pool, config }
    }

    /// One pass: batches until a batch comes back short.
    pub async fn run_once(&self) -> Result<ReapSummary, ReapError> {
        let mut summary = ReapSummary::default();
        let mut conn = self.pool.get().await?;
        loop {
            let counts: BatchCounts = diesel::sql_query(REAP_BATCH)
                .bind::<diesel::sql_types::Double, _>(self.config.key_ttl.as_secs_f64())
                .bind::<diesel::sql_types::Double, _>(self.config.lock_rule.secs().0)
                .bind::<BigInt, _>(self.config.batch_size)
                .bind::<diesel::sql_types::Double, _>(self.config.lock_rule.secs().1)
                .get_result(&mut conn)
                .await?;
            summary.batches += 1;
            summary.deleted += u64::try_from(counts.deleted).unwrap_or(0);
            summary.unfinished_recorded += u64::try_from(counts.recorded).unwrap_or(0);
            if counts.recorded > 0 {
                tracing::warn!(
                    count = counts.recorded,
                    "reaped unfinished keys; recorded for a human"
                );
            }
            if counts.deleted < self.config.batch_size {
                summary.record();
                return Ok(summary);
            }
        }
    }

    pub async fn run(&self, shutdown_token: CancellationToken) -> ReapSummary {
        let interval = self.config.interval.max(Duration::from_secs(1));
        let mut passes = ReaperPasses {
            reaper: self,
            interval,
            total: ReapSummary::default(),
        };
        let failing = Backoff::new(interval, interval);
        worker_loop::run_passes(&mut passes, &shutdown_token, failing).await;
        passes.total
    }
}

/// The reaper's loop state: every pass, then wait the interval.
struct ReaperPasses<'a> {
    reaper: &'a Reaper,
    interval: Duration,
    total: ReapSummary,
}

impl Passes for ReaperPasses<'_> {
    type Error = ReapError;
    const WORKER: &'static str = "reaper";

    async fn pass(&mut self) -> Result<Next, ReapError> {
        let summary = self.reaper.run_once().await?;
        self.total.batches += summary.batches;
        self.total.deleted += summary.deleted;
        self.total.unfinished_recorded += summary.unfinished_recorded;
        if summary.deleted > 0 {
            tracing::info!(?summary, "reaper pass");
        }
        Ok(Next::After(self.interval))
    }
}
