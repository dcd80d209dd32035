//! Refunding a finding's charge: money taken that no ride stands for (`unrecorded_charge`,
//! `unknown_ride`). Never by default: only `workers reconciler --refund` or
//! `workers admin findings refund <id> --yes` get here, and both go through [`refund_finding`].
//!
//! Made once, whatever runs it how often: the refund carries the provider idempotency key
//! derived from the finding (`contract::key::provider_refund_idempotency_key`), so a re-run, a
//! concurrent run or a retry after a lost answer gets the first refund back from the provider. The
//! finding row is locked for the whole call, so two refunders of one finding take turns, and the
//! second finds it resolved. Should the provider have forgotten the key (24 hours at Stripe), a
//! second refund would be refused as `charge_already_refunded`; the refund already made (the one
//! whose metadata names this finding) is then looked up and recorded instead. A charge refunded by
//! anyone else stays an open finding with the provider's refusal, for a person to resolve.
//!
//! Before refunding, the preconditions are re-checked under row locks: the ride (if any) still
//! does not record the charge, and its key is not live (a key an operator handed back to the
//! completer may yet record it). The ride and key rows stay locked until the refund is recorded,
//! so neither can change in between.

use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use provider::{Refund, RefundRequest, StripeClient};
use schema::{
    Pool, RecoveryPoint,
    models::ReconciliationFinding,
    schema::{idempotency_keys, reconciliation_findings, rides},
};
use serde_json::json;

use super::classify::KeyFacts;
use crate::admin::{AdminError, Change, ChangeReport, Mode, bound_waits};

/// Refunds finding `id`'s charge (`Mode::Apply`), or shows what would be done.
pub async fn refund_finding(
    pool: &Pool,
    stripe: &StripeClient,
    id: i64,
    mode: Mode,
) -> Result<ChangeReport, AdminError> {
    let mut conn = pool.get().await?;
    let report = crate::admin::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let finding = lock_refundable(conn, id, mode).await?;
            let mut report = ChangeReport::new("findings refund", mode, id);
            report
                .notes
                .push(crate::admin::findings::describe(&finding));
            let key = contract::key::provider_refund_idempotency_key(id);
            let planned = |refund_id: Option<&str>| {
                Change::insert(
                    "provider refunds",
                    json!({
                        "payment_intent": finding.payment_intent_id,
                        "amount": finding.provider_amount,
                        "currency": finding.provider_currency,
                        "idempotency_key": key,
                        "refund_id": refund_id,
                    }),
                )
            };
            if !mode.applies() {
                report.changes.push(planned(None));
                report
                    .changes
                    .push(resolution_change(id, "refund (id after --yes)"));
                return Ok::<ChangeReport, AdminError>(report);
            }
            let refund = make_refund(stripe, &finding, key.clone()).await?;
            report.changes.push(planned(Some(&refund.id)));
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
            Ok(report)
        })
        .await?;
    if mode.applies() {
        tracing::warn!(
            finding_id = id,
            "reconciler: finding refunded at the provider"
        );
    }
    Ok(report)
}

fn resolution_change(id: i64, resolution: &str) -> Change {
    Change::update(
        "reconciliation_findings",
        id,
        "resolution",
        serde_json::Value::Null,
        json!(resolution),
    )
}

/// Locks the finding (and its ride and key) and checks that refunding it is right.
async fn lock_refundable(
    conn: &mut AsyncPgConnection,
    id: i64,
    mode: Mode,
) -> Result<ReconciliationFinding, AdminError> {
    let finding = crate::admin::findings::load(conn, id, mode).await?;
    if let Some(resolved_at) = finding.resolved_at {
        return Err(AdminError::Refused(format!(
            "finding {id} was resolved at {} ({}); nothing is refunded",
            crate::admin::render::time(resolved_at),
            finding.resolution.as_deref().unwrap_or("-")
        )));
    }
    if !finding.kind.is_refundable() {
        return Err(AdminError::Refused(format!(
            "finding {id} is {}: a ride stands for that charge; only unrecorded_charge and \
             unknown_ride findings are refunded",
            finding.kind
        )));
    }
    let ride: Option<(Option<i64>, Option<String>)> = match finding.ride_id {
        Some(ride_id) => {
            let query = rides::table
                .find(ride_id)
                .select((rides::idempotency_key_id, rides::stripe_charge_id));
            if mode.applies() {
                query.for_update().first(conn).await.optional()?
            } else {
                query.first(conn).await.optional()?
            }
        }
        None => None,
    };
    if let Some((_, Some(recorded))) = &ride
        && *recorded == finding.payment_intent_id
    {
        return Err(AdminError::Refused(format!(
            "ride {} now records {recorded}: it is not an unrecorded charge any more; resolve the \
             finding instead",
            finding.ride_id.unwrap_or_default()
        )));
    }
    let key_id = ride
        .and_then(|(key_id, _)| key_id)
        .or(finding.idempotency_key_id);
    if let Some(key_id) = key_id {
        check_key_not_live(conn, key_id, mode).await?;
    }
    Ok(finding)
}

async fn check_key_not_live(
    conn: &mut AsyncPgConnection,
    key_id: i64,
    mode: Mode,
) -> Result<(), AdminError> {
    let query = idempotency_keys::table.find(key_id).select((
        idempotency_keys::recovery_point,
        idempotency_keys::completer_gave_up_at,
    ));
    let key: Option<(RecoveryPoint, Option<chrono::DateTime<chrono::Utc>>)> = if mode.applies() {
        query.for_update().first(conn).await.optional()?
    } else {
        query.first(conn).await.optional()?
    };
    let live = key.is_some_and(|(recovery_point, gave_up_at)| {
        KeyFacts {
            recovery_point,
            completer_gave_up: gave_up_at.is_some(),
        }
        .is_live()
    });
    if live {
        return Err(AdminError::Refused(format!(
            "key {key_id} is unfinished and the completer has not given up on it: it may still \
             record this charge (see `workers admin key show --key-id {key_id}`)"
        )));
    }
    Ok(())
}

/// The provider call: one refund per finding, however often it is asked for.
async fn make_refund(
    stripe: &StripeClient,
    finding: &ReconciliationFinding,
    idempotency_key: String,
) -> Result<Refund, AdminError> {
    let request = RefundRequest {
        payment_intent: finding.payment_intent_id.clone(),
        reason: "duplicate",
        metadata: vec![
            ("finding_id", finding.id.to_string()),
            ("finding_kind", finding.kind.to_string()),
        ],
        idempotency_key,
    };
    match stripe.refund(&request).await {
        Ok(refund) => Ok(refund),
        Err(error) if error.code() == Some("charge_already_refunded") => {
            // Our key expired at the provider after an earlier refund whose recording was lost,
            // or someone else refunded the charge: only a refund carrying this finding's id is
            // ours to record; anyone else's leaves the finding open for a person to resolve.
            let finding_id = finding.id.to_string();
            let refunds = stripe.list_refunds(&finding.payment_intent_id).await?;
            let ours = refunds.into_iter().find(|refund| {
                refund.status == "succeeded"
                    && refund.metadata.get("finding_id") == Some(&finding_id)
            });
            ours.ok_or(AdminError::Provider(error))
        }
        Err(error) => Err(AdminError::Provider(error)),
    }
}
