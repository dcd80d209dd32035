//! Recording findings: each mismatch once. A finding already recorded (same kind, same
//! PaymentIntent) only has its `last_seen_at` moved, whether it is open or resolved: a resolved
//! finding stays resolved (the operator decided), and a re-run never duplicates one.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use diesel::ExpressionMethods;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{models::NewReconciliationFinding, schema::reconciliation_findings};

use super::ReconcileError;

/// Rows per statement: 11 parameters a row stays far below PostgreSQL's 65,535.
const CHUNK: usize = 1000;

/// Records `findings`; returns how many were new.
pub(super) async fn record(
    conn: &mut AsyncPgConnection,
    findings: &[NewReconciliationFinding],
) -> Result<u64, ReconcileError> {
    // One statement may not touch a row twice (ON CONFLICT DO UPDATE refuses it).
    let mut unique = HashSet::new();
    let findings: Vec<&NewReconciliationFinding> = findings
        .iter()
        .filter(|finding| unique.insert((finding.kind, finding.payment_intent_id.as_str())))
        .collect();
    let mut new = 0;
    for chunk in findings.chunks(CHUNK) {
        let seen: Vec<(DateTime<Utc>, DateTime<Utc>)> =
            diesel::insert_into(reconciliation_findings::table)
                .values(chunk.iter().copied().cloned().collect::<Vec<_>>())
                .on_conflict((
                    reconciliation_findings::kind,
                    reconciliation_findings::payment_intent_id,
                ))
                .do_update()
                .set(reconciliation_findings::last_seen_at.eq(diesel::dsl::now))
                .returning((
                    reconciliation_findings::first_seen_at,
                    reconciliation_findings::last_seen_at,
                ))
                .get_results(conn)
                .await?;
        // A row inserted by this transaction has both times equal to its start; one seen before
        // was first seen by an earlier transaction.
        new += seen.iter().filter(|(first, last)| first == last).count() as u64;
    }
    Ok(new)
}
