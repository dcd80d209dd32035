//! Refunding a finding's charge: money of ours taken that no ride stands for
//! (`unrecorded_charge`). Never by default: only `workers reconciler --refund` or
//! `workers admin findings refund <id> --operator <name> --yes` get here, and both go through [`refund_finding`].
//!
//! The charge is proven ours again first, with the provider's PaymentIntent as it is now and the
//! database's key, ride and customer as they are now, by the one ownership rule
//! (`contract::ownership`): a finding recorded by an older reconciler (whose rule trusted any of
//! our metadata keys), or one whose key has since been reaped, is refused, and a person decides.
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
//!
//! A refunded key is final: the transaction that records the refund also finishes the key, if
//! it is unfinished, with the stored outcome [`Outcome::PaymentRefunded`] (replayed as
//! `FAILED_PRECONDITION`/`PAYMENT_REFUNDED`) and clears its lock. A rider's retry of that key then
//! replays the refusal instead of resuming the key (the provider would hand the same, refunded,
//! PaymentIntent back and it would be recorded as the ride's payment); an attempt in flight is
//! fenced off at its next phase; the completer only picks unfinished keys.

use contract::ownership;
use provider::{Refund, RefundRequest, StripeClient};
use schema::{Pool, models::ReconciliationFinding};
use serde_json::json;

use crate::admin::{AdminError, Change, ChangeReport, Mode, bound_waits};

mod checks;
mod record;

use self::{checks::*, record::*};

/// Who or what asked for a refund, as the audit records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefundRequester {
    /// `workers reconciler --refund`, within its caps.
    Reconciler,
    /// `workers admin findings refund <id> --operator <name> --yes`: one finding, approved by a
    /// person.
    Operator(String),
}

impl RefundRequester {
    /// `operator:<name>`; the name is 1 to 100 visible characters.
    pub fn operator(name: &str) -> Result<RefundRequester, AdminError> {
        let name = name.trim();
        if name.is_empty() || name.chars().count() > 100 || name.chars().any(char::is_control) {
            return Err(AdminError::Invalid(
                "--operator must be 1 to 100 printable characters: who approves this refund".into(),
            ));
        }
        Ok(RefundRequester::Operator(name.to_owned()))
    }

    pub fn label(&self) -> String {
        match self {
            RefundRequester::Reconciler => "reconciler --refund".to_owned(),
            RefundRequester::Operator(name) => format!("operator:{name}"),
        }
    }
}

/// Refunds finding `id`'s charge (`Mode::Apply`), or shows what would be done; `requester` is
/// who asked, for the audit.
pub async fn refund_finding(
    pool: &Pool,
    stripe: &StripeClient,
    id: i64,
    mode: Mode,
    requester: &RefundRequester,
) -> Result<ChangeReport, AdminError> {
    let mut conn = pool.get().await?;
    let report = crate::admin::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let finding = lock_refundable(conn, id, mode).await?;
            let proven = prove_ours(conn, stripe, &finding, mode).await?;
            let mut report = ChangeReport::new("findings refund", mode, id);
            report
                .notes
                .push(crate::admin::findings::describe(&finding));
            let key =
                contract::key::provider_refund_idempotency_key(stripe.deployment_id().as_str(), id);
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
                if let Some(change) =
                    proven.tombstone_change("payment_refunded (refund id after --yes)")
                {
                    report.changes.push(change);
                }
                report
                    .changes
                    .push(resolution_change(id, "refund (id after --yes)"));
                return Ok::<ChangeReport, AdminError>(report);
            }
            let refund = make_refund(stripe, &finding, key.clone()).await?;
            let (refund, oversized) = fit_refund(&finding, refund);
            if let Some(oversized) = oversized {
                record_oversized(conn, &oversized, &mut report).await?;
            }
            report.changes.push(planned(Some(&refund.id)));
            let audit = Audit {
                finding_id: id,
                payment_intent_id: &finding.payment_intent_id,
                refund_id: &refund.id,
                amount: refund.amount,
                currency: &refund.currency,
                reason: format!(
                    "{}: {}",
                    finding.kind,
                    crate::admin::findings::describe(&finding)
                ),
                requested_by: requester.label(),
                deployment_id: stripe.deployment_id().as_str(),
            };
            audit.record(conn, &mut report).await?;
            // The key is final in the same commit that records the refund: a rider's retry
            // replays PAYMENT_REFUNDED instead of resuming it, which would get the same (now
            // refunded) PaymentIntent back from the provider and record it as the ride's payment.
            tombstone_key(conn, &proven, &finding, &refund, &mut report).await?;
            resolve_finding(conn, id, &refund, &mut report).await?;
            Ok(report)
        })
        .await?;
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
            (
                ownership::METADATA_DEPLOYMENT_ID,
                stripe.deployment_id().as_str().to_owned(),
            ),
        ],
        idempotency_key,
    };
    match stripe.refund(&request).await {
        Ok(refund) => Ok(refund),
        Err(error) if error.code() == Some("charge_already_refunded") => {
            // Our key expired at the provider after an earlier refund whose recording was lost,
            // or someone else refunded the charge: only a refund carrying this finding's id is
            // ours to record; anyone else's leaves the finding open for a person to resolve.
            // A refund made before deployment ids carries no marker; one made since carries
            // ours (another deployment's finding of the same id carries its own).
            let finding_id = finding.id.to_string();
            let refunds = stripe.list_refunds(&finding.payment_intent_id).await?;
            let ours = refunds.into_iter().find(|refund| {
                let marker = refund.metadata.get(ownership::METADATA_DEPLOYMENT_ID);
                refund.status == "succeeded"
                    && refund.metadata.get("finding_id") == Some(&finding_id)
                    && marker.is_none_or(|marker| marker == stripe.deployment_id().as_str())
            });
            ours.ok_or(AdminError::Provider(error))
        }
        Err(error) => Err(AdminError::Provider(error)),
    }
}
