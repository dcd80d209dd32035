//! `workers admin backlog`: what is waiting, where. Read-only.

use chrono::{DateTime, Utc};
use diesel::{
    QueryableByName,
    sql_types::{BigInt, Text, Timestamptz},
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

/// Database part first: when RabbitMQ is down the staged backlog is exactly what an operator
/// needs to see, so a broker failure is reported next to it rather than hiding it.
pub async fn backlog(
    pool: &Pool,
    amqp_url: &str,
    topology: &Topology,
) -> Result<Backlog, AdminError> {
    let mut conn = pool.get().await?;
    let (now, staged_jobs, keys_needing_attention) = conn
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
            Ok::<_, AdminError>((now, staged, attention.count))
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
