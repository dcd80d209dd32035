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

use contract::{
    Outcome, PAYMENT_REFUNDED,
    key::KeyMoved,
    ownership::{self, KeyRecord},
};
use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl,
    sql_types::{BigInt, Integer, Jsonb},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use provider::{Refund, RefundRequest, StripeClient};
use schema::{
    FindingKind, Pool, RecoveryPoint,
    models::{NewReconciliationFinding, ReconciliationFinding},
    schema::{idempotency_keys, reconciliation_findings, rides, users},
};
use serde_json::json;

use super::classify::{KeyFacts, MAX_CURRENCY, MAX_STATUS, cut, fit_id};
use crate::admin::{AdminError, Change, ChangeReport, Mode, bound_waits, render};

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
            audit.record(conn).await?;
            report.changes.push(Change::insert(
                "refund_audits",
                json!({
                    "finding_id": id,
                    "payment_intent": finding.payment_intent_id,
                    "refund_id": refund.id,
                    "amount": refund.amount,
                    "currency": refund.currency,
                    "reason": audit.reason,
                    "requested_by": audit.requested_by,
                }),
            ));
            // The key is final in the same commit that records the refund: a rider's retry
            // replays PAYMENT_REFUNDED instead of resuming it, which would get the same (now
            // refunded) PaymentIntent back from the provider and record it as the ride's payment.
            if proven.key_unfinished {
                let outcome = Outcome::PaymentRefunded {
                    ride_id: Some(proven.ride_id),
                    payment_intent: finding.payment_intent_id.clone(),
                    refund_id: refund.id.clone(),
                    message: PAYMENT_REFUNDED.to_owned(),
                };
                let stored = outcome.to_stored();
                let finished: Vec<KeyMoved> = diesel::sql_query(TOMBSTONE_REFUNDED_KEY)
                    .bind::<BigInt, _>(proven.key_id)
                    .bind::<Integer, _>(stored.code)
                    .bind::<Jsonb, _>(&stored.body)
                    .load(conn)
                    .await?;
                if finished.is_empty() {
                    return Err(AdminError::Internal(format!(
                        "key {} changed while locked; the refund {} is not recorded",
                        proven.key_id, refund.id
                    )));
                }
                if let Some(change) = proven.tombstone_change(&render::outcome(&outcome)) {
                    report.changes.push(change);
                }
            }
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
    Ok(report)
}

/// A refund whose id or currency is longer than the columns hold (Stripe's are far shorter)
/// would fail its recording after the money moved, on every attempt, and leave its key
/// resumable, so that a rider's retry could still record the refunded charge. It is recorded
/// with its values cut to fit (as a PaymentIntent's are, `classify::fit_id`), and an
/// `oversized_value` finding of its own asks a person to look the refund up at the provider.
fn fit_refund(
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
async fn record_oversized(
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
struct Audit<'a> {
    finding_id: i64,
    payment_intent_id: &'a str,
    refund_id: &'a str,
    amount: i64,
    currency: &'a str,
    reason: String,
    requested_by: String,
    deployment_id: &'a str,
}

impl Audit<'_> {
    /// The row, in the refund's transaction, and the log line with the same fields (logged
    /// before the commit: a line without a row means the commit failed, and the next attempt at
    /// the finding finds the refund by its provider key and records it then).
    async fn record(&self, conn: &mut AsyncPgConnection) -> Result<(), AdminError> {
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
        Ok(())
    }
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
            "finding {id} is {}: only unrecorded_charge findings (charges proven ours that no \
             ride stands for) are refunded; settle others at the provider and `resolve` them",
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

/// Finishes a refunded charge's key (`$1`) with the stored outcome `$2`, `$3`
/// ([`Outcome::PaymentRefunded`]) if it is still unfinished; its lock, if an attempt holds one,
/// is cleared, so that attempt's next phase is fenced off and records nothing.
const TOMBSTONE_REFUNDED_KEY: &str = concat!(
    contract::finish_key!("$2", "$3"),
    " WHERE id = $1 AND recovery_point <> 'finished' RETURNING id"
);

/// What [`prove_ours`] proved: whose charge it is.
struct Proven {
    key_id: i64,
    ride_id: i64,
    /// The key is not finished: the refund finishes it ([`TOMBSTONE_REFUNDED_KEY`]). A finished
    /// key already has its final outcome (another charge recorded for the ride, a decline an
    /// operator stored) and keeps it.
    key_unfinished: bool,
}

impl Proven {
    fn tombstone_change(&self, outcome: &str) -> Option<Change> {
        self.key_unfinished.then(|| {
            Change::update(
                "idempotency_keys",
                self.key_id,
                "outcome",
                serde_json::Value::Null,
                json!(outcome),
            )
        })
    }
}

/// Proves the finding's PaymentIntent ours, as it stands now at the provider and in the
/// database (the key row and its ride are locked when applying, so they stay so until the
/// refund is recorded); refuses otherwise.
async fn prove_ours(
    conn: &mut AsyncPgConnection,
    stripe: &StripeClient,
    finding: &ReconciliationFinding,
    mode: Mode,
) -> Result<Proven, AdminError> {
    let pi = &finding.payment_intent_id;
    let Some(intent) = stripe.retrieve_payment_intent(pi).await? else {
        return Err(AdminError::Refused(format!(
            "the provider has no PaymentIntent {pi}; nothing is refunded"
        )));
    };
    // The refund caps count the finding's amount: never refund more than it says.
    if finding.provider_amount != Some(intent.amount) {
        return Err(AdminError::Refused(format!(
            "PaymentIntent {pi} is of {} now, the finding says {:?}: nothing is refunded",
            intent.amount, finding.provider_amount
        )));
    }
    let key_id = ownership::key_id(&intent.metadata);
    let key: Option<(i64, RecoveryPoint)> = match key_id {
        Some(key_id) => {
            let query = idempotency_keys::table
                .find(key_id)
                .select((idempotency_keys::user_id, idempotency_keys::recovery_point));
            if mode.applies() {
                query.for_update().first(conn).await.optional()?
            } else {
                query.first(conn).await.optional()?
            }
        }
        None => None,
    };
    let ride: Option<(i64, i64, String, Option<String>)> = match key_id {
        Some(key_id) => rides::table
            .filter(rides::idempotency_key_id.eq(key_id))
            .select((
                rides::id,
                rides::amount,
                rides::currency,
                rides::deployment_id,
            ))
            .first(conn)
            .await
            .optional()?,
        None => None,
    };
    let customer: Option<String> = match &key {
        Some((user_id, _)) => users::table
            .find(user_id)
            .select(users::stripe_customer_id)
            .first(conn)
            .await
            .optional()?,
        None => None,
    };
    let record = match (key_id, &key, &ride, &customer) {
        (
            Some(key_id),
            Some(_),
            Some((ride_id, amount, currency, deployment_id)),
            Some(customer),
        ) => Some(KeyRecord {
            key_id,
            deployment_id: deployment_id.as_deref(),
            customer,
            ride_id: *ride_id,
            amount: *amount,
            currency,
        }),
        _ => None,
    };
    let facts = super::classify::intent_facts(&intent);
    if let Err(why) = ownership::verdict(stripe.deployment_id().as_str(), &facts, record.as_ref()) {
        return Err(AdminError::Refused(format!(
            "PaymentIntent {pi} is not provably ours ({why}): nothing is refunded; check it at the \
             provider and `resolve` the finding"
        )));
    }
    if let (Some(named), Some((ride_id, _, _, _))) = (finding.ride_id, &ride)
        && named != *ride_id
    {
        return Err(AdminError::Refused(format!(
            "finding {} names ride {named}, but PaymentIntent {pi} is the charge of ride \
             {ride_id}; nothing is refunded",
            finding.id
        )));
    }
    match (key_id, key, ride) {
        (Some(key_id), Some((_, recovery_point)), Some((ride_id, _, _, _))) => Ok(Proven {
            key_id,
            ride_id,
            key_unfinished: recovery_point != RecoveryPoint::Finished,
        }),
        // The verdict above needs all three.
        _ => Err(AdminError::Internal(format!(
            "PaymentIntent {pi} was proven ours without a key"
        ))),
    }
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
