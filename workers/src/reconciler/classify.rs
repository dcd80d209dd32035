//! Classification: given what the provider and the database say about one window (a
//! [`Ledger`]), every mismatch as a finding to record, and the charges that are not findings
//! *yet*. Pure: no I/O, so each rule is tested on its own (below) besides the end-to-end tests.
//!
//! The rules (docs/workers.md, "Reconciler"):
//! - A PaymentIntent a ride records (matched by id) must be `succeeded`, of the ride's amount and
//!   currency: otherwise `charge_not_succeeded`, `amount_mismatch`, `currency_mismatch`.
//! - A ride of the window that records a PaymentIntent the provider does not have:
//!   `missing_charge`.
//! - A succeeded PaymentIntent that no ride records is matched by its `metadata.ride_id`. While
//!   its key is live (exists, unfinished, not given up by the completer) it is *pending*: the
//!   completer will record it. Otherwise: `unrecorded_charge` if the ride exists, `unknown_ride`
//!   if it does not (or the metadata names none).
//! - PaymentIntents without any of our metadata keys are someone else's on the same account and
//!   are left alone; ones that took no money (declines, unconfirmed) need nothing.

use std::collections::{HashMap, HashSet};

use provider::ListedIntent;
use schema::{FindingKind, RecoveryPoint, models::NewReconciliationFinding};

/// The metadata keys the api-server puts on every charge.
pub const METADATA_RIDE_ID: &str = "ride_id";
pub const METADATA_USER_ID: &str = "user_id";
pub const METADATA_KEY_ID: &str = "idempotency_key_id";

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

/// Everything one pass knows about its window.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    /// The provider's PaymentIntents of the window, plus those pending from earlier passes.
    pub intents: Vec<ListedIntent>,
    /// The rides created in the window that record a charge.
    pub window_rides: Vec<RideFacts>,
    /// Rides by id: those of the window, those the intents' metadata name, those recording an
    /// intent.
    pub rides: HashMap<i64, RideFacts>,
    /// Keys that still exist, by id (a missing id was reaped).
    pub keys: HashMap<i64, KeyFacts>,
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
    /// PaymentIntents without our metadata.
    pub foreign: u64,
}

pub fn classify(ledger: &Ledger) -> Classified {
    let mut out = Classified::default();
    let by_charge: HashMap<&str, &RideFacts> = ledger
        .rides
        .values()
        .filter_map(|ride| Some((ride.stripe_charge_id.as_deref()?, ride)))
        .collect();
    let mut seen: HashSet<&str> = HashSet::new();
    for intent in &ledger.intents {
        if !seen.insert(intent.id.as_str()) {
            continue;
        }
        match by_charge.get(intent.id.as_str()) {
            Some(ride) => compare(ride, intent, &mut out),
            None => unrecorded(ledger, intent, &mut out),
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
    if out.findings.len() == before {
        out.matched += 1;
    }
}

/// A PaymentIntent no ride records.
fn unrecorded(ledger: &Ledger, intent: &ListedIntent, out: &mut Classified) {
    let metadata = &intent.metadata;
    let ours = [METADATA_RIDE_ID, METADATA_USER_ID, METADATA_KEY_ID]
        .iter()
        .any(|key| metadata.contains_key(*key));
    if !ours {
        out.foreign += 1;
        return;
    }
    if intent.status != SUCCEEDED {
        // A decline or an unconfirmed intent took no money; the ride (if any) says so itself.
        return;
    }
    let ride = metadata_id(intent, METADATA_RIDE_ID).and_then(|id| ledger.rides.get(&id));
    let key_id = ride
        .and_then(|ride| ride.idempotency_key_id)
        .or_else(|| metadata_id(intent, METADATA_KEY_ID));
    let live = key_id
        .and_then(|id| ledger.keys.get(&id))
        .is_some_and(|key| key.is_live());
    if live {
        out.pending.push(Pending {
            payment_intent_id: intent.id.clone(),
        });
        return;
    }
    let mut new = match ride {
        Some(ride) => finding(
            FindingKind::UnrecordedCharge,
            &intent.id,
            Some(ride),
            Some(intent),
        ),
        None => finding(FindingKind::UnknownRide, &intent.id, None, Some(intent)),
    };
    new.ride_id = new
        .ride_id
        .or_else(|| metadata_id(intent, METADATA_RIDE_ID));
    new.user_id = new
        .user_id
        .or_else(|| metadata_id(intent, METADATA_USER_ID));
    new.idempotency_key_id = key_id;
    out.findings.push(new);
}

fn metadata_id(intent: &ListedIntent, key: &str) -> Option<i64> {
    intent.metadata.get(key)?.parse().ok()
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
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn intent(id: &str, ride: Option<i64>, key: Option<i64>) -> ListedIntent {
        let mut metadata = BTreeMap::new();
        if let Some(ride) = ride {
            metadata.insert(METADATA_RIDE_ID.to_owned(), ride.to_string());
            metadata.insert(METADATA_USER_ID.to_owned(), "7".to_owned());
        }
        if let Some(key) = key {
            metadata.insert(METADATA_KEY_ID.to_owned(), key.to_string());
        }
        ListedIntent {
            id: id.to_owned(),
            status: SUCCEEDED.to_owned(),
            amount: 2000,
            currency: "usd".to_owned(),
            created: 0,
            metadata,
        }
    }

    fn ride(id: i64, key: Option<i64>, charge: Option<&str>) -> RideFacts {
        RideFacts {
            id,
            user_id: 7,
            idempotency_key_id: key,
            amount: 2000,
            currency: "usd".to_owned(),
            stripe_charge_id: charge.map(str::to_owned),
        }
    }

    fn ledger(intents: Vec<ListedIntent>, rides: Vec<RideFacts>) -> Ledger {
        Ledger {
            intents,
            rides: rides.into_iter().map(|ride| (ride.id, ride)).collect(),
            ..Ledger::default()
        }
    }

    fn kinds(classified: &Classified) -> Vec<FindingKind> {
        classified.findings.iter().map(|f| f.kind).collect()
    }

    #[test]
    fn a_recorded_charge_that_agrees_is_matched() {
        let out = classify(&ledger(
            vec![intent("pi_a", Some(1), Some(10))],
            vec![ride(1, Some(10), Some("pi_a"))],
        ));
        assert_eq!(kinds(&out), []);
        assert_eq!(out.matched, 1);
    }

    #[test]
    fn an_unrecorded_charge_is_pending_while_its_key_is_live_and_a_finding_after() {
        let mut ledger = ledger(
            vec![intent("pi_a", Some(1), Some(10))],
            vec![ride(1, Some(10), None)],
        );
        ledger.keys.insert(
            10,
            KeyFacts {
                recovery_point: RecoveryPoint::RideCreated,
                completer_gave_up: false,
            },
        );
        let out = classify(&ledger);
        assert_eq!(kinds(&out), []);
        assert_eq!(out.pending.len(), 1);

        ledger.keys.insert(
            10,
            KeyFacts {
                recovery_point: RecoveryPoint::RideCreated,
                completer_gave_up: true,
            },
        );
        assert_eq!(kinds(&classify(&ledger)), [FindingKind::UnrecordedCharge]);
        ledger.keys.clear();
        let out = classify(&ledger);
        assert_eq!(kinds(&out), [FindingKind::UnrecordedCharge]);
        assert_eq!(out.findings[0].idempotency_key_id, Some(10));
        assert_eq!(out.findings[0].ride_amount, Some(2000));
    }

    #[test]
    fn foreign_and_unsuccessful_intents_are_left_alone() {
        let mut declined = intent("pi_d", Some(1), Some(10));
        declined.status = "requires_payment_method".to_owned();
        let out = classify(&ledger(
            vec![intent("pi_f", None, None), declined],
            vec![ride(1, None, None)],
        ));
        assert_eq!(kinds(&out), []);
        assert_eq!(out.foreign, 1);
    }

    #[test]
    fn an_unknown_ride_carries_the_metadata_ids() {
        let out = classify(&ledger(vec![intent("pi_u", Some(99), Some(5))], vec![]));
        assert_eq!(kinds(&out), [FindingKind::UnknownRide]);
        assert_eq!(out.findings[0].ride_id, Some(99));
        assert_eq!(out.findings[0].user_id, Some(7));
        assert_eq!(out.findings[0].idempotency_key_id, Some(5));
        assert_eq!(out.findings[0].ride_amount, None);
    }

    #[test]
    fn a_recorded_charge_can_disagree_in_several_ways_at_once() {
        let mut odd = intent("pi_a", Some(1), Some(10));
        odd.status = "canceled".to_owned();
        odd.amount = 1;
        odd.currency = "eur".to_owned();
        let out = classify(&ledger(vec![odd], vec![ride(1, Some(10), Some("pi_a"))]));
        assert_eq!(
            kinds(&out),
            [
                FindingKind::ChargeNotSucceeded,
                FindingKind::AmountMismatch,
                FindingKind::CurrencyMismatch
            ]
        );
        assert_eq!(out.matched, 0);
    }

    #[test]
    fn a_window_ride_whose_charge_the_provider_lacks_is_missing() {
        let mut ledger = ledger(vec![], vec![]);
        ledger.window_rides = vec![ride(1, None, Some("pi_gone"))];
        ledger.looked_up.insert("pi_gone".to_owned(), None);
        let out = classify(&ledger);
        assert_eq!(kinds(&out), [FindingKind::MissingCharge]);
        assert_eq!(out.findings[0].provider_status, None);
    }
}
