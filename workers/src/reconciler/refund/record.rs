//! After a refund: the audit row and its log line, the refunded key finished as
//! `payment_refunded`, the finding resolved; a refund too long for the columns cut to fit with a
//! finding of its own.

use contract::{Outcome, PAYMENT_REFUNDED};
use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl,
    sql_types::{BigInt, Integer, Jsonb},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use provider::Refund;
use schema::{
    FindingKind,
    models::{NewReconciliationFinding, ReconciliationFinding},
    schema::reconciliation_findings,
};
use serde_json::json;

use crate::admin::{AdminError, Change, ChangeReport, render};
use crate::reconciler::classify::{MAX_CURRENCY, MAX_STATUS, cut, fit_id};

use super::*;

/// A refund whose id or currency is longer than the columns hold (Stripe's are far shorter)
/// would fail its recording after the money moved, on every attempt, and leave its key
/// resumable, so that a rider's retry could still record the refunded charge. It is recorded
/// with its values cut to fit (as a PaymentIntent's are, `classify::fit_id`), and an
/// `oversized_value` finding of its own asks a person to look the refund up at the provider.
pub(super) fn fit_refund(
    finding: &ReconciliationFinding,
    refund: Refund,
) -> (Refund, Option<NewReconciliationFinding>) {
    let fitted = Refund {
        id: fit_id(&refund.id),
        currency: cut(&refund.currency, MAX_CURRENCY),
        ..refund.clone()
    };
    if fitted.id == refund.id && fitted.currency == refund.currency {
        return (refund, None);
    }
    tracing::warn!(
        finding_id = finding.id,
        payment_intent = finding.payment_intent_id,
        refund_id = fitted.id,
        "refund made at the provider with values longer than this service stores; recorded cut \
         to fit, with an oversized_value finding"
    );
    let oversized = NewReconciliationFinding {
        kind: FindingKind::OversizedValue,
        payment_intent_id: finding.payment_intent_id.clone(),
        ride_id: finding.ride_id,
        user_id: finding.user_id,
        idempotency_key_id: finding.idempotency_key_id,
        provider_amount: Some(refund.amount),
        provider_currency: Some(fitted.currency.clone()),
        provider_status: Some(cut(&format!("refund {}", refund.status), MAX_STATUS)),
        ride_amount: finding.ride_amount,
        ride_currency: finding.ride_currency.clone(),
    };
    (fitted, Some(oversized))
}

/// The refund's `oversized_value` finding, in the refund's transaction (once per PaymentIntent).
pub(super) async fn record_oversized(
    conn: &mut AsyncPgConnection,
    oversized: &NewReconciliationFinding,
    report: &mut ChangeReport,
) -> Result<(), AdminError> {
    let id: Option<i64> = diesel::insert_into(reconciliation_findings::table)
        .values(oversized)
        .on_conflict((
            reconciliation_findings::kind,
            reconciliation_findings::payment_intent_id,
        ))
        .do_nothing()
        .returning(reconciliation_findings::id)
        .get_result(conn)
        .await
        .optional()?;
    let mut change = Change::insert(
        "reconciliation_findings",
        json!({"kind": oversized.kind.as_str(), "payment_intent": oversized.payment_intent_id}),
    );
    change.row = id;
    report.changes.push(change);
    report.warnings.push(
        "the provider's refund id (or currency) is longer than this service stores: recorded cut \
         to fit, with an oversized_value finding; look the refund up at the provider"
            .to_owned(),
    );
    Ok(())
}

/// One refund as `refund_audits` records it and the log line says it.
pub(super) struct Audit<'a> {
    pub(super) finding_id: i64,
    pub(super) payment_intent_id: &'a str,
    pub(super) refund_id: &'a str,
    pub(super) amount: i64,
    pub(super) currency: &'a str,
    pub(super) reason: String,
    pub(super) requested_by: String,
    pub(super) deployment_id: &'a str,
}

impl Audit<'_> {
    /// The row, in the refund's transaction, and the log line with the same fields (logged
    /// before the commit: a line without a row means the commit failed, and the next attempt at
    /// the finding finds the refund by its provider key and records it then).
    pub(super) async fn record(
        &self,
        conn: &mut AsyncPgConnection,
        report: &mut ChangeReport,
    ) -> Result<(), AdminError> {
        use schema::schema::refund_audits as audits;
        tracing::warn!(
            finding_id = self.finding_id,
            payment_intent = self.payment_intent_id,
            refund_id = self.refund_id,
            amount = self.amount,
            currency = self.currency,
            reason = %self.reason,
            requested_by = %self.requested_by,
            deployment_id = self.deployment_id,
            "refund made at the provider"
        );
        diesel::insert_into(audits::table)
            .values((
                audits::finding_id.eq(self.finding_id),
                audits::payment_intent_id.eq(self.payment_intent_id),
                audits::refund_id.eq(self.refund_id),
                audits::amount.eq(self.amount),
                audits::currency.eq(self.currency),
                audits::reason.eq(&self.reason),
                audits::requested_by.eq(&self.requested_by),
                audits::deployment_id.eq(self.deployment_id),
            ))
            .execute(conn)
            .await?;
        report.changes.push(Change::insert(
            "refund_audits",
            json!({
                "finding_id": self.finding_id,
                "payment_intent": self.payment_intent_id,
                "refund_id": self.refund_id,
                "amount": self.amount,
                "currency": self.currency,
                "reason": self.reason,
                "requested_by": self.requested_by,
            }),
        ));
        Ok(())
    }
}

/// Finishes a refunded charge's key (`$1`) with the stored outcome `$2`, `$3`
/// ([`Outcome::PaymentRefunded`]) if it is still unfinished; its lock, if an attempt holds one,
/// is cleared, so that attempt's next phase is fenced off and records nothing.
pub(super) const TOMBSTONE_REFUNDED_KEY: &str = "UPDATE idempotency_keys \
     SET recovery_point = 'finished', response_code = $2, response_body = $3, \
     locked_at = NULL, lock_token = NULL, lock_holder = NULL \
     WHERE id = $1 AND recovery_point <> 'finished'";

/// Finishes the refunded charge's key, if it is unfinished, with the stored outcome
/// [`Outcome::PaymentRefunded`] and no lock ([`TOMBSTONE_REFUNDED_KEY`]).
pub(super) async fn tombstone_key(
    conn: &mut AsyncPgConnection,
    proven: &Proven,
    finding: &ReconciliationFinding,
    refund: &Refund,
    report: &mut ChangeReport,
) -> Result<(), AdminError> {
    if !proven.key_unfinished {
        return Ok(());
    }
    let outcome = Outcome::PaymentRefunded {
        ride_id: Some(proven.ride_id),
        payment_intent: finding.payment_intent_id.clone(),
        refund_id: refund.id.clone(),
        message: PAYMENT_REFUNDED.to_owned(),
    };
    let stored = outcome.to_stored();
    let finished = diesel::sql_query(TOMBSTONE_REFUNDED_KEY)
        .bind::<BigInt, _>(proven.key_id)
        .bind::<Integer, _>(stored.code)
        .bind::<Jsonb, _>(&stored.body)
        .execute(conn)
        .await?;
    if finished == 0 {
        return Err(AdminError::Internal(format!(
            "key {} changed while locked; the refund {} is not recorded",
            proven.key_id, refund.id
        )));
    }
    if let Some(change) = proven.tombstone_change(&render::outcome(&outcome)) {
        report.changes.push(change);
    }
    Ok(())
}

/// Resolves the finding with the refund it was refunded by.
pub(super) async fn resolve_finding(
    conn: &mut AsyncPgConnection,
    id: i64,
    refund: &Refund,
    report: &mut ChangeReport,
) -> Result<(), AdminError> {
    let resolution = format!(
        "refunded {} {} as {}",
        refund.amount, refund.currency, refund.id
    );
    diesel::update(reconciliation_findings::table.find(id))
        .set((
            reconciliation_findings::refund_id.eq(&refund.id),
            reconciliation_findings::resolved_at.eq(diesel::dsl::now),
            reconciliation_findings::resolution.eq(&resolution),
        ))
        .execute(conn)
        .await?;
    report.changes.push(resolution_change(id, &resolution));
    Ok(())
}
