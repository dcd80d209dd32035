//! One batch out of `staged_jobs`: the oldest staged jobs locked for this enqueuer, and the
//! jobs the broker returned set aside.

use diesel::{
    BoolExpressionMethods, ExpressionMethods, QueryDsl, SelectableHelper,
    sql_types::{Array, BigInt, Bool, Double, Integer, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use lapin::Channel;
use schema::{models::StagedJob, schema::staged_jobs};

use crate::{backoff::exponential, config::EnqueuerConfig, topology::Topology};

use super::*;

/// One batch inside its transaction: select and lock the due jobs, publish, delete what was
/// confirmed and set aside what came back.
pub(super) async fn batch_in(
    conn: &mut AsyncPgConnection,
    channel: &Channel,
    topology: &Topology,
    config: &EnqueuerConfig,
) -> Result<BatchOutcome, EnqueueError> {
    let jobs: Vec<StagedJob> = staged_jobs::table
        .filter(staged_jobs::parked_at.is_null())
        .filter(
            staged_jobs::next_attempt_at
                .is_null()
                .or(staged_jobs::next_attempt_at.le(diesel::dsl::now)),
        )
        .order(staged_jobs::id)
        .limit(config.batch_size)
        .for_update()
        .skip_locked()
        .select(StagedJob::as_select())
        .load(conn)
        .await?;
    let selected = jobs.len();
    if jobs.is_empty() {
        return Ok(BatchOutcome {
            selected,
            summary: EnqueueSummary::default(),
            error: None,
        });
    }
    let published = publish_all(channel, topology, &jobs, config.confirm_timeout).await;
    if !published.confirmed.is_empty() {
        diesel::delete(staged_jobs::table.filter(staged_jobs::id.eq_any(&published.confirmed)))
            .execute(conn)
            .await?;
    }
    let parked = set_aside(conn, &jobs, &published.refused, config).await?;
    let refused = published.refused.len() as u64;
    Ok(BatchOutcome {
        selected,
        summary: EnqueueSummary {
            batches: 1,
            published: published.confirmed.len() as u64,
            returned: published.returned,
            nacked: published.nacked,
            set_aside: refused - parked,
            parked,
        },
        error: published.error,
    })
}

/// Gives every returned or nacked job of the batch its next attempt time, or parks it once it
/// has had `max_attempts`, in one statement. Returns how many were parked.
pub(super) async fn set_aside(
    conn: &mut AsyncPgConnection,
    jobs: &[StagedJob],
    refused: &[(i64, String)],
    config: &EnqueuerConfig,
) -> Result<u64, EnqueueError> {
    if refused.is_empty() {
        return Ok(0);
    }
    let mut ids = Vec::with_capacity(refused.len());
    let mut attempts = Vec::with_capacity(refused.len());
    let mut delays = Vec::with_capacity(refused.len());
    let mut park = Vec::with_capacity(refused.len());
    let mut errors = Vec::with_capacity(refused.len());
    for (id, error) in refused {
        let before = jobs
            .iter()
            .find(|job| job.id == *id)
            .map_or(0, |job| job.attempts);
        let now = before.saturating_add(1);
        let exponent = u32::try_from(now - 1).unwrap_or(0);
        ids.push(*id);
        attempts.push(now);
        delays.push(exponential(config.backoff_base, exponent, config.backoff_max).as_secs_f64());
        park.push(now >= config.max_attempts);
        errors.push(error.chars().take(2000).collect::<String>());
    }
    diesel::sql_query(
        "UPDATE staged_jobs AS job SET attempts = refused.attempts, \
         next_attempt_at = CASE WHEN refused.park THEN NULL \
             ELSE now() + make_interval(secs => refused.delay) END, \
         parked_at = CASE WHEN refused.park THEN now() END, \
         last_error = refused.error \
         FROM unnest($1, $2, $3, $4, $5) AS refused(id, attempts, delay, park, error) \
         WHERE job.id = refused.id",
    )
    .bind::<Array<BigInt>, _>(&ids)
    .bind::<Array<Integer>, _>(&attempts)
    .bind::<Array<Double>, _>(&delays)
    .bind::<Array<Bool>, _>(&park)
    .bind::<Array<Text>, _>(&errors)
    .execute(conn)
    .await?;
    let parked = park.iter().filter(|parked| **parked).count() as u64;
    if parked > 0 {
        tracing::error!(
            parked,
            max_attempts = config.max_attempts,
            "staged jobs parked for a human after every attempt came back"
        );
    }
    Ok(parked)
}
