//! `workers admin backlog`: what is waiting, where. Read-only.

use std::fmt::Write as _;

use super::render::relative;

use chrono::{DateTime, Utc};
use diesel::{
    QueryableByName,
    sql_types::{BigInt, Integer, Nullable, Text, Timestamptz},
};
use diesel_async::RunQueryDsl;
use schema::Pool;
use serde::Serialize;

use super::{AdminError, QueueDepth, bound_waits, connect_broker, db_now, queue_depth};
use crate::topology::Topology;

#[derive(Clone, Debug, Serialize)]
pub struct Backlog {
    pub now: DateTime<Utc>,
    /// Staged jobs the enqueuer has not published yet, per job name.
    pub staged_jobs: Vec<StagedBacklog>,
    /// The part of `staged_jobs` the broker returned or refused: waiting out a back-off
    /// (`set_aside`) or given up on until a human clears `parked_at` (`parked`).
    pub held_jobs: Vec<HeldBacklog>,
    /// Unresolved `keys_needing_attention` rows.
    pub keys_needing_attention: i64,
    /// The receipts and dead-letter queues; empty when the broker could not be asked.
    pub queues: Vec<QueueDepth>,
    /// Why the queues are missing (the command then exits non-zero after printing the rest).
    pub queues_error: Option<String>,
}

#[derive(Clone, Debug, Serialize, QueryableByName)]
pub struct StagedBacklog {
    #[diesel(sql_type = Text)]
    pub job_name: String,
    #[diesel(sql_type = BigInt)]
    pub count: i64,
    #[diesel(sql_type = Timestamptz)]
    pub oldest_created_at: DateTime<Utc>,
}

#[derive(Clone, Debug, Serialize, QueryableByName)]
pub struct HeldBacklog {
    #[diesel(sql_type = Text)]
    pub job_name: String,
    /// `set_aside` or `parked`.
    #[diesel(sql_type = Text)]
    pub state: String,
    #[diesel(sql_type = BigInt)]
    pub count: i64,
    #[diesel(sql_type = Timestamptz)]
    pub oldest_created_at: DateTime<Utc>,
    /// The oldest such job, to look at.
    #[diesel(sql_type = BigInt)]
    pub oldest_id: i64,
    #[diesel(sql_type = Integer)]
    pub max_attempts: i32,
    /// What the broker said about the oldest one.
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
}

/// Database part first: when RabbitMQ is down the staged backlog is exactly what an operator
/// needs to see, so a broker failure is reported next to it rather than hiding it.
pub async fn backlog(
    pool: &Pool,
    amqp_url: &str,
    topology: &Topology,
) -> Result<Backlog, AdminError> {
    let mut conn = pool.get().await?;
    let (now, staged_jobs, held_jobs, keys_needing_attention) = conn
        .build_transaction()
        .read_committed()
        .read_only()
        .run(async |conn| {
            bound_waits(conn).await?;
            let now = db_now(conn).await?;
            let staged: Vec<StagedBacklog> = diesel::sql_query(
                "SELECT job_name, count(*) AS count, min(created_at) AS oldest_created_at \
                 FROM staged_jobs GROUP BY job_name ORDER BY job_name",
            )
            .load(conn)
            .await?;
            let held: Vec<HeldBacklog> = diesel::sql_query(
                "SELECT job_name, \
                     CASE WHEN parked_at IS NULL THEN 'set_aside' ELSE 'parked' END AS state, \
                     count(*) AS count, min(created_at) AS oldest_created_at, \
                     min(id) AS oldest_id, max(attempts) AS max_attempts, \
                     (array_agg(last_error ORDER BY id))[1] AS last_error \
                 FROM staged_jobs WHERE next_attempt_at IS NOT NULL OR parked_at IS NOT NULL \
                 GROUP BY 1, 2 ORDER BY 1, 2",
            )
            .load(conn)
            .await?;
            #[derive(QueryableByName)]
            struct Count {
                #[diesel(sql_type = BigInt)]
                count: i64,
            }
            let attention: Count = diesel::sql_query(
                "SELECT count(*) AS count FROM keys_needing_attention WHERE resolved_at IS NULL",
            )
            .get_result(conn)
            .await?;
            Ok::<_, AdminError>((now, staged, held, attention.count))
        })
        .await?;
    drop(conn);
    let (queues, queues_error) = match queue_depths(amqp_url, topology).await {
        Ok(queues) => (queues, None),
        Err(error) => (Vec::new(), Some(error.describe())),
    };
    Ok(Backlog {
        now,
        staged_jobs,
        held_jobs,
        keys_needing_attention,
        queues,
        queues_error,
    })
}

async fn queue_depths(amqp_url: &str, topology: &Topology) -> Result<Vec<QueueDepth>, AdminError> {
    let connection = connect_broker(amqp_url).await?;
    let mut depths = Vec::new();
    let mut result = Ok(());
    for queue in [&topology.receipts_queue, &topology.dead_letter_queue] {
        match queue_depth(&connection, queue).await {
            Ok(depth) => depths.push(depth),
            Err(error) => {
                result = Err(error);
                break;
            }
        }
    }
    let _ = connection.close(200, "bye".into()).await;
    result.map(|()| depths)
}

impl Backlog {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let now = self.now;
        let mut out = String::new();
        if self.staged_jobs.is_empty() {
            let _ = writeln!(out, "Staged jobs: none");
        } else {
            let _ = writeln!(out, "Staged jobs (not yet published)");
            for staged in &self.staged_jobs {
                let _ = writeln!(
                    out,
                    "  {:<24}{:>8} oldest {}",
                    staged.job_name,
                    staged.count,
                    relative(staged.oldest_created_at, now)
                );
            }
        }
        if !self.held_jobs.is_empty() {
            let _ = writeln!(
                out,
                "Staged jobs the broker returned or refused (set_aside: retried after a back-off; \
                 parked: waiting for a human)"
            );
            for held in &self.held_jobs {
                let _ = writeln!(
                    out,
                    "  {:<24}{:<10}{:>8} oldest {} (job {}, {} attempt(s)): {}",
                    held.job_name,
                    held.state,
                    held.count,
                    relative(held.oldest_created_at, now),
                    held.oldest_id,
                    held.max_attempts,
                    held.last_error.as_deref().unwrap_or("-")
                );
            }
        }
        let _ = writeln!(out, "Queues");
        for queue in &self.queues {
            let _ = writeln!(
                out,
                "  {:<32}{:>8} message(s) {:>4} consumer(s)",
                queue.queue, queue.messages, queue.consumers
            );
        }
        if let Some(error) = &self.queues_error {
            let _ = writeln!(out, "  unavailable: {error}");
        }
        let _ = writeln!(
            out,
            "Keys needing attention (unresolved): {}",
            self.keys_needing_attention
        );
        out
    }
}
