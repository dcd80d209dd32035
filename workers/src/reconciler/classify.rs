//! Classification: given what the provider and the database say about one window (a
//! [`Ledger`]), every mismatch as a finding to record, and the charges that are not findings
//! *yet*. Pure: no I/O, so each rule is tested on its own (`tests`) besides the end-to-end tests.
//!
//! The rules (docs/workers.md, "Reconciler"):
//! - A PaymentIntent whose id, currency or status is longer than the findings' columns allow is
//!   an `oversized_value` finding (its values cut to fit) and is compared no further: one odd
//!   object must not fail every pass on the insert.
//! - A PaymentIntent a ride records (matched by id) must be `succeeded`, of the ride's amount and
//!   currency, and not refunded (its expanded charge's `amount_refunded` is 0): otherwise
//!   `charge_not_succeeded`, `amount_mismatch`, `currency_mismatch`, `refunded_charge` (the ride
//!   still counts as paid).
//! - A ride of the window that records a PaymentIntent the provider does not have:
//!   `missing_charge`.
//! - A PaymentIntent that no ride records must first be proven ours by the ownership rule
//!   (`contract::ownership`: deployment marker, key id resolving in our database, the key's
//!   customer, ride and amount). One that is not is someone else's on the shared account: it is
//!   counted (`foreign`, and `look_alikes` for those that carry any of our metadata keys) and
//!   left alone, never a finding that could be refunded. One that carries this deployment's
//!   marker but fails the rest of the proof is an `unknown_ride` finding for a person: never
//!   refunded by the tools.
//! - A succeeded PaymentIntent proven ours that no ride records: while its key is live (exists,
//!   unfinished, not given up by the completer) it is *pending*: the completer will record it.
//!   Otherwise `unrecorded_charge`. Ones that took no money (declines, unconfirmed) need nothing.

use std::collections::{HashMap, HashSet};

use contract::ownership::{
    self, IntentFacts, KeyRecord, METADATA_KEY_ID, METADATA_RIDE_ID, METADATA_USER_ID, NotOurs,
};
use provider::ListedIntent;
use schema::{FindingKind, RecoveryPoint, models::NewReconciliationFinding};

const SUCCEEDED: &str = "succeeded";

/// A ride as the reconciler compares it (the columns it reads).
#[derive(Clone, Debug, PartialEq, Eq, diesel::Queryable, diesel::Selectable)]
#[diesel(table_name = schema::schema::rides, check_for_backend(diesel::pg::Pg))]
pub struct RideFacts {
    pub id: i64,
    pub user_id: i64,
    pub idempotency_key_id: Option<i64>,
    pub amount: i64,
    pub currency: String,
    pub stripe_charge_id: Option<String>,
    /// The deployment the ride was created under (`None`: before deployment ids).
    pub deployment_id: Option<String>,
}

/// An idempotency key that still exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyFacts {
    pub recovery_point: RecoveryPoint,
    pub completer_gave_up: bool,
}

impl KeyFacts {
    /// The completer will still drive this key to the end (and record its charge). The one
    /// statement of this rule: classification and the refund's re-check both ask it.
    pub fn is_live(self) -> bool {
        let finished = match self.recovery_point {
            RecoveryPoint::Finished => true,
            RecoveryPoint::Started | RecoveryPoint::RideCreated | RecoveryPoint::ChargeCreated => {
                false
            }
        };
        !finished && !self.completer_gave_up
    }
}

/// Who a key that still exists belongs to: what the ownership rule compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyOwner {
    pub user_id: i64,
}

/// Everything one pass knows about its window.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    /// This installation's `DEPLOYMENT_ID`.
    pub deployment_id: String,
    /// The provider's PaymentIntents of the window, plus those pending from earlier passes.
    pub intents: Vec<ListedIntent>,
    /// The rides created in the window that record a charge.
    pub window_rides: Vec<RideFacts>,
    /// Rides by id: those of the window, those the intents' metadata name, those recording an
    /// intent.
    pub rides: HashMap<i64, RideFacts>,
    /// Keys that still exist, by id (a missing id was reaped).
    pub keys: HashMap<i64, KeyFacts>,
    /// The owners of the keys the intents' metadata names, by key id.
    pub owners: HashMap<i64, KeyOwner>,
    /// The Stripe customer of each of those owners, by user id.
    pub customers: HashMap<i64, String>,
    /// PaymentIntents the window's rides record that were not listed, looked up by id: `None`
    /// when the provider has no such PaymentIntent.
    pub looked_up: HashMap<String, Option<ListedIntent>>,
}

/// A charge that is no finding yet because its key is live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    pub payment_intent_id: String,
}

#[derive(Clone, Debug, Default)]
pub struct Classified {
    pub findings: Vec<NewReconciliationFinding>,
    pub pending: Vec<Pending>,
    /// PaymentIntents a ride records, with nothing wrong.
    pub matched: u64,
    /// PaymentIntents no ride records that the ownership rule does not prove ours.
    pub foreign: u64,
    /// Of those, the ones carrying any of our metadata keys (someone else's look-alike, or a
    /// charge of ours that can no longer be proven, e.g. of a reaped key), by reason.
    pub look_alikes: HashMap<NotOurs, u64>,
}

pub fn classify(ledger: &Ledger) -> Classified {
    let mut out = Classified::default();
    let by_charge: HashMap<&str, &RideFacts> = ledger
        .rides
        .values()
        .filter_map(|ride| Some((ride.stripe_charge_id.as_deref()?, ride)))
        .collect();
    let by_key: HashMap<i64, &RideFacts> = ledger
        .rides
        .values()
        .filter_map(|ride| Some((ride.idempotency_key_id?, ride)))
        .collect();
    let mut seen: HashSet<&str> = HashSet::new();
    for intent in &ledger.intents {
        if !seen.insert(intent.id.as_str()) {
            continue;
        }
        if let Some(oversized) = oversized(intent) {
            out.findings.push(oversized);
            continue;
        }
        match by_charge.get(intent.id.as_str()) {
            Some(ride) => compare(ride, intent, &mut out),
            None => unrecorded(ledger, &by_key, intent, &mut out),
        }
    }
    for ride in &ledger.window_rides {
        let Some(charge_id) = ride.stripe_charge_id.as_deref() else {
            continue;
        };
        if !seen.insert(charge_id) {
            continue;
        }
        match ledger.looked_up.get(charge_id) {
            Some(Some(intent)) => compare(ride, intent, &mut out),
            Some(None) => out.findings.push(finding(
                FindingKind::MissingCharge,
                charge_id,
                Some(ride),
                None,
            )),
            // Not looked up (the walk asks for every unlisted one): nothing can be said.
            None => {}
        }
    }
    out
}

/// What a PaymentIntent says about itself, for the ownership rule.
pub(crate) fn intent_facts(intent: &ListedIntent) -> IntentFacts<'_> {
    IntentFacts {
        metadata: &intent.metadata,
        customer: intent.customer.as_deref(),
        amount: intent.amount,
        currency: &intent.currency,
    }
}

/// The bounds of `reconciliation_findings`' provider columns (its CHECK constraints; a refund's
/// id and currency have the same in `refund_audits`).
pub(crate) const MAX_ID: usize = 255;
pub(crate) const MAX_CURRENCY: usize = 16;
pub(crate) const MAX_STATUS: usize = 64;

/// `value` cut to at most `max` characters.
pub(crate) fn cut(value: &str, max: usize) -> String {
    value.chars().take(max).collect()
}

/// A provider id cut to fit [`MAX_ID`]; a cut one ends in `…` and its full length in characters,
/// so that nobody mistakes it for the whole id.
pub(crate) fn fit_id(id: &str) -> String {
    let chars = id.chars().count();
    if chars <= MAX_ID {
        return id.to_owned();
    }
    let suffix = format!("…({chars} chars)");
    format!("{}{suffix}", cut(id, MAX_ID - suffix.chars().count()))
}

/// An `oversized_value` finding for a PaymentIntent with a value longer than its column, with
/// every value cut to fit (an id cut short ends in `…` and its full length in characters).
fn oversized(intent: &ListedIntent) -> Option<NewReconciliationFinding> {
    let chars = |value: &str| value.chars().count();
    if chars(&intent.id) <= MAX_ID
        && chars(&intent.currency) <= MAX_CURRENCY
        && chars(&intent.status) <= MAX_STATUS
    {
        return None;
    }
    let id = fit_id(&intent.id);
    tracing::warn!(
        payment_intent = %id,
        "reconciler: a PaymentIntent has values longer than the findings can hold"
    );
    let mut new = finding(FindingKind::OversizedValue, &id, None, None);
    new.provider_amount = Some(intent.amount);
    new.provider_currency = Some(cut(&intent.currency, MAX_CURRENCY));
    new.provider_status = Some(cut(&intent.status, MAX_STATUS));
    Some(new)
}

/// A ride and the PaymentIntent it records.
fn compare(ride: &RideFacts, intent: &ListedIntent, out: &mut Classified) {
    let before = out.findings.len();
    if intent.status != SUCCEEDED {
        out.findings.push(finding(
            FindingKind::ChargeNotSucceeded,
            &intent.id,
            Some(ride),
            Some(intent),
        ));
    }
    if intent.amount != ride.amount {
        out.findings.push(finding(
            FindingKind::AmountMismatch,
            &intent.id,
            Some(ride),
            Some(intent),
        ));
    }
    if !intent.currency.eq_ignore_ascii_case(&ride.currency) {
        out.findings.push(finding(
            FindingKind::CurrencyMismatch,
            &intent.id,
            Some(ride),
            Some(intent),
        ));
    }
    if intent
        .amount_refunded()
        .is_some_and(|refunded| refunded > 0)
    {
        out.findings.push(finding(
            FindingKind::RefundedCharge,
            &intent.id,
            Some(ride),
            Some(intent),
        ));
    }
    if out.findings.len() == before {
        out.matched += 1;
    }
}

/// A PaymentIntent no ride records.
fn unrecorded(
    ledger: &Ledger,
    by_key: &HashMap<i64, &RideFacts>,
    intent: &ListedIntent,
    out: &mut Classified,
) {
    let key_id = ownership::key_id(&intent.metadata);
    let ride = key_id.and_then(|id| by_key.get(&id).copied());
    let record = key_id.and_then(|id| {
        let owner = ledger.owners.get(&id)?;
        let ride = ride?;
        Some(KeyRecord {
            key_id: id,
            deployment_id: ride.deployment_id.as_deref(),
            customer: ledger.customers.get(&owner.user_id)?,
            ride_id: ride.id,
            amount: ride.amount,
            currency: &ride.currency,
        })
    });
    let facts = intent_facts(intent);
    if let Err(why) = ownership::verdict(&ledger.deployment_id, &facts, record.as_ref()) {
        not_ours(ledger, intent, why, out);
        return;
    }
    if intent.status != SUCCEEDED {
        // A decline or an unconfirmed intent took no money; the ride says so itself.
        return;
    }
    let live = key_id
        .and_then(|id| ledger.keys.get(&id))
        .is_some_and(|key| key.is_live());
    if live {
        out.pending.push(Pending {
            payment_intent_id: intent.id.clone(),
        });
        return;
    }
    out.findings.push(finding(
        FindingKind::UnrecordedCharge,
        &intent.id,
        ride,
        Some(intent),
    ));
}

/// A PaymentIntent the ownership rule refused: counted and left alone, or, if it carries this
/// deployment's marker and took money, an `unknown_ride` finding for a person (never refunded by
/// the tools: nothing proves whose it is).
fn not_ours(ledger: &Ledger, intent: &ListedIntent, why: NotOurs, out: &mut Classified) {
    let metadata = &intent.metadata;
    if ownership::carries_marker(metadata, &ledger.deployment_id) && intent.status == SUCCEEDED {
        tracing::warn!(
            payment_intent = %intent.id,
            reason = %why,
            "reconciler: a charge carries our deployment marker but is not provably ours"
        );
        let mut new = finding(FindingKind::UnknownRide, &intent.id, None, Some(intent));
        new.ride_id = ownership::metadata_id(metadata, METADATA_RIDE_ID);
        new.user_id = ownership::metadata_id(metadata, METADATA_USER_ID);
        new.idempotency_key_id = ownership::key_id(metadata);
        out.findings.push(new);
        return;
    }
    out.foreign += 1;
    let look_alike = [METADATA_RIDE_ID, METADATA_USER_ID, METADATA_KEY_ID]
        .iter()
        .any(|key| metadata.contains_key(*key));
    if look_alike {
        *out.look_alikes.entry(why).or_default() += 1;
        tracing::info!(
            payment_intent = %intent.id,
            reason = %why,
            "reconciler: a PaymentIntent with our metadata keys is not ours; ignored"
        );
    }
}

fn finding(
    kind: FindingKind,
    payment_intent_id: &str,
    ride: Option<&RideFacts>,
    intent: Option<&ListedIntent>,
) -> NewReconciliationFinding {
    NewReconciliationFinding {
        kind,
        payment_intent_id: payment_intent_id.to_owned(),
        ride_id: ride.map(|ride| ride.id),
        user_id: ride.map(|ride| ride.user_id),
        idempotency_key_id: ride.and_then(|ride| ride.idempotency_key_id),
        provider_amount: intent.map(|intent| intent.amount),
        provider_currency: intent.map(|intent| intent.currency.clone()),
        provider_status: intent.map(|intent| intent.status.clone()),
        ride_amount: ride.map(|ride| ride.amount),
        ride_currency: ride.map(|ride| ride.currency.clone()),
    }
}

#[cfg(test)]
mod tests;
