//! The money invariants ([`crate::money`]), checked once drained against the provider's ledger
//! and refunds (read from fake-stripe), `refund_audits`, the rides, the receipts and the mail.
//! The campaign knows the other product's charges by their tag, which the service never reads;
//! every other PaymentIntent was made by our api-servers.

use std::collections::{BTreeMap, HashMap, HashSet};

use diesel::{
    QueryableByName,
    sql_types::{BigInt, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde_json::{Value, json};

use crate::{
    evidence::{Evidence, fetch_list},
    invariants::Violations,
    money::MoneyKey,
    other_product::VARIANTS,
    setup::Wiring,
};

/// The invariants checked here (listed with the others in `invariants::INVARIANTS`).
pub(crate) const INVARIANTS: [&str; 6] = [
    "no_foreign_refund",
    "no_foreign_recorded",
    "no_paid_after_refund",
    "refunds_audited",
    "no_receipt_unrecorded",
    "money_exercised",
];

/// A refund at the provider.
pub(crate) struct ProviderRefund {
    id: String,
    payment_intent: String,
    amount: i64,
}

#[derive(QueryableByName)]
pub(crate) struct AuditRow {
    #[diesel(sql_type = Text)]
    refund_id: String,
    #[diesel(sql_type = Text)]
    payment_intent_id: String,
    #[diesel(sql_type = BigInt)]
    amount: i64,
}

/// What the money invariants read beyond [`Evidence`].
pub(crate) struct MoneyEvidence {
    refunds: Vec<ProviderRefund>,
    audits: Vec<AuditRow>,
}

pub(crate) async fn collect(
    conn: &mut AsyncPgConnection,
    http: &reqwest::Client,
    wiring: &Wiring,
) -> anyhow::Result<MoneyEvidence> {
    let refunds = fetch_list(http, &wiring.stripe_base, "/v1/refunds")
        .await?
        .iter()
        .map(|refund| ProviderRefund {
            id: refund["id"].as_str().unwrap_or_default().to_owned(),
            payment_intent: refund["payment_intent"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            amount: refund["amount"].as_i64().unwrap_or_default(),
        })
        .collect();
    let audits =
        diesel::sql_query("SELECT refund_id, payment_intent_id, amount FROM refund_audits")
            .load(conn)
            .await?;
    Ok(MoneyEvidence { refunds, audits })
}

/// Checks the money invariants into `v`; returns the figures the report shows.
pub(crate) fn judge(
    ev: &Evidence,
    money: &MoneyEvidence,
    keys: &[MoneyKey],
    v: &mut Violations,
) -> BTreeMap<String, u64> {
    let mut figures: BTreeMap<String, u64> = BTreeMap::new();
    let foreign: HashSet<&str> = ev.foreign.iter().map(|pi| pi.id.as_str()).collect();
    let refunded: HashSet<&str> = money
        .refunds
        .iter()
        .map(|refund| refund.payment_intent.as_str())
        .collect();
    foreign_left_alone(ev, money, &foreign, v, &mut figures);
    refunds_audited(money, v, &mut figures);
    for ride in &ev.rides {
        if let Some(charge) = ride.stripe_charge_id.as_deref()
            && refunded.contains(charge)
        {
            v.add(
                "no_paid_after_refund",
                format!("ride {} records the refunded charge {charge}", ride.id),
            );
        }
    }
    riders(keys, v, &mut figures);
    receipts(ev, &refunded, &foreign, keys, v, &mut figures);
    figures.insert("refunded_charges".into(), refunded.len() as u64);
    exercised(ev, &figures, keys, v);
    figures
}

/// No refund, record or refundable finding of another product's charge.
fn foreign_left_alone(
    ev: &Evidence,
    money: &MoneyEvidence,
    foreign: &HashSet<&str>,
    v: &mut Violations,
    figures: &mut BTreeMap<String, u64>,
) {
    for pi in &ev.foreign {
        *figures
            .entry(format!("other_product_charges.{}", pi.variant))
            .or_default() += 1;
    }
    let ours: HashSet<&str> = ev.ledger.iter().map(|pi| pi.id.as_str()).collect();
    for refund in &money.refunds {
        if foreign.contains(refund.payment_intent.as_str()) {
            v.add(
                "no_foreign_refund",
                format!(
                    "refund {} of the other product's charge {}",
                    refund.id, refund.payment_intent
                ),
            );
        } else if !ours.contains(refund.payment_intent.as_str()) {
            v.add(
                "no_foreign_refund",
                format!(
                    "refund {} of an unknown charge {}",
                    refund.id, refund.payment_intent
                ),
            );
        }
    }
    for ride in &ev.rides {
        if ride
            .stripe_charge_id
            .as_deref()
            .is_some_and(|charge| foreign.contains(charge))
        {
            v.add(
                "no_foreign_recorded",
                format!(
                    "ride {} records the other product's charge {:?}",
                    ride.id, ride.stripe_charge_id
                ),
            );
        }
    }
    for finding in &ev.reconciliation.findings {
        if !foreign.contains(finding.payment_intent_id.as_str()) {
            continue;
        }
        *figures
            .entry(format!("other_product_findings.{}", finding.kind))
            .or_default() += 1;
        if finding.kind == "unrecorded_charge" {
            v.add(
                "no_foreign_recorded",
                format!(
                    "finding #{} makes the other product's charge {} refundable",
                    finding.id, finding.payment_intent_id
                ),
            );
        }
    }
}

/// One audit row per provider refund, naming its charge and amount, and no audit without one.
fn refunds_audited(money: &MoneyEvidence, v: &mut Violations, figures: &mut BTreeMap<String, u64>) {
    let mut audits: HashMap<&str, Vec<&AuditRow>> = HashMap::new();
    for audit in &money.audits {
        audits
            .entry(audit.refund_id.as_str())
            .or_default()
            .push(audit);
    }
    for refund in &money.refunds {
        match audits.get(refund.id.as_str()).map(Vec::as_slice) {
            Some([audit])
                if audit.payment_intent_id == refund.payment_intent
                    && audit.amount == refund.amount => {}
            other => v.add(
                "refunds_audited",
                format!(
                    "refund {} of {} ({}): {} audit row(s) matching",
                    refund.id,
                    refund.payment_intent,
                    refund.amount,
                    other.map_or(0, <[&AuditRow]>::len)
                ),
            ),
        }
    }
    let made: HashSet<&str> = money
        .refunds
        .iter()
        .map(|refund| refund.id.as_str())
        .collect();
    for audit in &money.audits {
        if !made.contains(audit.refund_id.as_str()) {
            v.add(
                "refunds_audited",
                format!(
                    "audit of refund {} the provider does not hold",
                    audit.refund_id
                ),
            );
        }
    }
    figures.insert("provider_refunds".into(), money.refunds.len() as u64);
    figures.insert("refund_audits".into(), money.audits.len() as u64);
}

/// The money riders: a retry after the refund never answers OK.
fn riders(keys: &[MoneyKey], v: &mut Violations, figures: &mut BTreeMap<String, u64>) {
    let mut count = |name: &str, yes: bool| {
        *figures.entry(format!("rider_keys.{name}")).or_default() += u64::from(yes);
    };
    for key in keys {
        count("total", true);
        count("given_up_by_the_completer", key.given_up);
        count("refunded_before_the_retry", key.refunded_before_retry);
        let last = key.answers.last().map(String::as_str).unwrap_or_default();
        count(
            "retry_answered_payment_refunded",
            last.ends_with("PAYMENT_REFUNDED"),
        );
        count("retry_answered_ok", last == "ok");
        if key.refunded_before_retry && last == "ok" {
            v.add(
                "no_paid_after_refund",
                format!(
                    "rider key {} (user {}) answered OK after its refund",
                    key.key, key.user_id
                ),
            );
        }
    }
}

/// Every receipt (sent or mailed) is of a ride that records a succeeded charge of ours that was
/// not refunded; the forged receipt jobs were never mailed.
fn receipts(
    ev: &Evidence,
    refunded: &HashSet<&str>,
    foreign: &HashSet<&str>,
    keys: &[MoneyKey],
    v: &mut Violations,
    figures: &mut BTreeMap<String, u64>,
) {
    let succeeded: HashSet<&str> = ev
        .ledger
        .iter()
        .filter(|pi| pi.status == "succeeded")
        .map(|pi| pi.id.as_str())
        .collect();
    let charge_of: HashMap<i64, Option<&str>> = ev
        .rides
        .iter()
        .map(|ride| (ride.id, ride.stripe_charge_id.as_deref()))
        .collect();
    let receipted: HashSet<i64> = ev
        .sent_receipts
        .iter()
        .copied()
        .chain(ev.mail.keys().copied())
        .collect();
    let mut unrecorded = 0;
    for ride in receipted {
        let fine = charge_of
            .get(&ride)
            .copied()
            .flatten()
            .is_some_and(|charge| {
                succeeded.contains(charge)
                    && !refunded.contains(charge)
                    && !foreign.contains(charge)
            });
        if !fine {
            unrecorded += 1;
            v.add(
                "no_receipt_unrecorded",
                format!(
                    "ride {ride} has a receipt but records {:?}",
                    charge_of.get(&ride).copied().flatten()
                ),
            );
        }
    }
    figures.insert("receipts_for_unrecorded_charges".into(), unrecorded);
    figures.insert(
        "forged_receipt_jobs_staged".into(),
        keys.iter().filter(|key| key.forged_receipt).count() as u64,
    );
}

/// The mode did what it claims, or its passes prove nothing.
fn exercised(
    ev: &Evidence,
    figures: &BTreeMap<String, u64>,
    keys: &[MoneyKey],
    v: &mut Violations,
) {
    let figure = |name: &str| figures.get(name).copied().unwrap_or(0);
    for variant in VARIANTS {
        if !ev.foreign.iter().any(|pi| pi.variant == variant) {
            v.add(
                "money_exercised",
                format!("no look-alike {variant} was made"),
            );
        }
    }
    for (name, what) in [
        ("provider_refunds", "no refund was made"),
        (
            "rider_keys.retry_answered_payment_refunded",
            "no retry of a refunded key was answered PAYMENT_REFUNDED",
        ),
        (
            "forged_receipt_jobs_staged",
            "no forged receipt job was staged",
        ),
    ] {
        if figure(name) == 0 {
            v.add("money_exercised", what.to_owned());
        }
    }
    // What the refunded keys answered last instead (the report lists a failing invariant's
    // first violations under it).
    if figure("rider_keys.retry_answered_payment_refunded") == 0 {
        for key in keys.iter().filter(|key| key.refunded_before_retry) {
            v.add(
                "money_exercised",
                format!(
                    "refunded key {} answered last {:?}",
                    key.key,
                    key.answers.last()
                ),
            );
        }
    }
}

/// The report's money section.
/// The money invariants judged (into `v`) and their report, when the campaign ran
/// (`keys`: the riders' keys and the passes' counts, `found`: what the ledger holds).
pub(crate) fn judge_and_report(
    ev: &Evidence,
    keys: Option<&(Vec<MoneyKey>, std::sync::Arc<crate::counters::Counters>)>,
    found: Option<&MoneyEvidence>,
    v: &mut Violations,
) -> Option<Value> {
    let ((keys, counts), found) = (keys?, found?);
    let figures = judge(ev, found, keys, v);
    Some(report(&figures, &counts.snapshot()))
}

pub(crate) fn report(figures: &BTreeMap<String, u64>, passes: &BTreeMap<String, u64>) -> Value {
    json!({ "figures": figures, "refunding_passes_and_other_product": passes })
}
