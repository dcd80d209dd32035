//! The reconciler at the end of the campaign: one `workers reconciler --once` pass over the whole
//! run (no settle delay, a window reaching back before the first charge), once the drains are
//! done and while fake-stripe still runs, and the findings it recorded. The invariants then
//! require that every finding is an expected one (an unrecorded charge of a key the completer
//! could not finish, listed in keys_needing_attention) and that each such charge was found.

use diesel::{
    QueryableByName,
    sql_types::{BigInt, Nullable, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde_json::Value;

use crate::{
    maintenance::run_once,
    setup::{Plan, Wiring},
};

#[derive(QueryableByName, Debug)]
pub(crate) struct FindingRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) id: i64,
    #[diesel(sql_type = Text)]
    pub(crate) kind: String,
    #[diesel(sql_type = Text)]
    pub(crate) payment_intent_id: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) ride_id: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) idempotency_key_id: Option<i64>,
}

pub(crate) struct Reconciliation {
    /// The pass's `--once` summary; `Err` with why if it failed.
    pub(crate) summary: Result<Value, String>,
    pub(crate) findings: Vec<FindingRow>,
}

/// The reconciler's environment in the campaign: no settle delay and no overlap (charges of live
/// keys wait as pending), reaching back before the first charge.
pub(crate) fn reconciler_env(wiring: &Wiring) -> Vec<(String, String)> {
    let mut env = wiring.env.clone();
    for (name, value) in [
        ("RECONCILER_SETTLE_SECS", "0"),
        ("RECONCILER_OVERLAP_SECS", "0"),
        // Far enough back for a --long run and its set-up.
        ("RECONCILER_LOOKBACK_HOURS", "2"),
    ] {
        env.push((name.to_owned(), value.to_owned()));
    }
    env
}

/// Runs the pass and reads what it recorded.
pub(crate) async fn reconcile(
    conn: &mut AsyncPgConnection,
    plan: &Plan,
    wiring: &Wiring,
) -> anyhow::Result<Reconciliation> {
    // A window ends at a whole second: let the last charge's second end.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let summary = run_once(
        &plan.bin_dir.join("workers"),
        "reconciler",
        &reconciler_env(wiring),
        &plan.log_dir.join("reconciler.log"),
    )
    .await
    .map_err(|error| format!("{error:#}"));
    let findings = diesel::sql_query(
        "SELECT id, kind, payment_intent_id, ride_id, idempotency_key_id \
         FROM reconciliation_findings ORDER BY id",
    )
    .load(conn)
    .await?;
    Ok(Reconciliation { summary, findings })
}
