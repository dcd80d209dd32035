//! The classification's unit tests, one or more per rule of the module's doc, on ledgers built
//! in memory: no database, no provider.

use std::collections::BTreeMap;

use contract::ownership::METADATA_DEPLOYMENT_ID;

use super::*;

const DEPLOYMENT: &str = "prod";

fn intent(id: &str, ride: Option<i64>, key: Option<i64>) -> ListedIntent {
    let mut metadata = BTreeMap::new();
    if let Some(ride) = ride {
        metadata.insert(METADATA_RIDE_ID.to_owned(), ride.to_string());
        metadata.insert(METADATA_USER_ID.to_owned(), "7".to_owned());
    }
    if let Some(key) = key {
        metadata.insert(METADATA_KEY_ID.to_owned(), key.to_string());
        metadata.insert(METADATA_DEPLOYMENT_ID.to_owned(), DEPLOYMENT.to_owned());
    }
    ListedIntent {
        id: id.to_owned(),
        status: SUCCEEDED.to_owned(),
        amount: 2000,
        currency: "usd".to_owned(),
        customer: Some("cus_7".to_owned()),
        created: 0,
        metadata,
        latest_charge: Some(provider::LatestCharge::Expanded {
            id: format!("ch_{id}"),
            amount_refunded: 0,
        }),
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
        deployment_id: Some(DEPLOYMENT.to_owned()),
    }
}

/// A ledger whose rides' keys exist and belong to user 7 (customer `cus_7`).
fn ledger(intents: Vec<ListedIntent>, rides: Vec<RideFacts>) -> Ledger {
    let owners = rides
        .iter()
        .filter_map(|ride| ride.idempotency_key_id)
        .map(|key| (key, KeyOwner { user_id: 7 }))
        .collect();
    Ledger {
        deployment_id: DEPLOYMENT.to_owned(),
        intents,
        rides: rides.into_iter().map(|ride| (ride.id, ride)).collect(),
        owners,
        customers: HashMap::from([(7, "cus_7".to_owned())]),
        ..Ledger::default()
    }
}

fn ledger_of(intents: Vec<ListedIntent>, rides: Vec<RideFacts>) -> Ledger {
    ledger(intents, rides)
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
    let out = classify(&ledger);
    assert_eq!(kinds(&out), [FindingKind::UnrecordedCharge]);
    assert_eq!(out.findings[0].idempotency_key_id, Some(10));
    assert_eq!(out.findings[0].ride_amount, Some(2000));
}

#[test]
fn a_charge_of_a_reaped_key_can_no_longer_be_proven_ours() {
    let mut ledger = ledger(
        vec![intent("pi_a", Some(1), Some(10))],
        vec![ride(1, Some(10), None)],
    );
    ledger.owners.clear();
    let out = classify(&ledger);
    // It carries our marker: a finding for a person, never a refundable one.
    assert_eq!(kinds(&out), [FindingKind::UnknownRide]);
    assert!(!out.findings[0].kind.is_refundable());
}

#[test]
fn look_alikes_of_another_product_are_counted_and_left_alone() {
    // The three look-alikes, on a ride and key of ours: a bare user_id, our ride id with another
    // customer and amount, our key id without our marker.
    let mut user_only = intent("pi_u", None, None);
    user_only
        .metadata
        .insert(METADATA_USER_ID.to_owned(), "7".to_owned());
    let mut other_ride = intent("pi_r", Some(1), None);
    other_ride.customer = Some("cus_other".to_owned());
    other_ride.amount = 4500;
    let mut key_only = intent("pi_k", None, None);
    key_only
        .metadata
        .insert(METADATA_KEY_ID.to_owned(), "10".to_owned());
    // Even with our marker copied, another customer is not ours (an unknown_ride for a
    // person, not a refund).
    let mut forged = intent("pi_f", Some(1), Some(10));
    forged.customer = Some("cus_other".to_owned());
    let out = classify(&ledger(
        vec![
            user_only,
            other_ride,
            key_only,
            forged,
            intent("pi_x", None, None),
        ],
        vec![ride(1, Some(10), None)],
    ));
    assert_eq!(kinds(&out), [FindingKind::UnknownRide]);
    assert_eq!(out.findings[0].payment_intent_id, "pi_f");
    assert_eq!(out.foreign, 4);
    assert_eq!(out.look_alikes.values().sum::<u64>(), 3);
    assert_eq!(out.look_alikes.get(&NotOurs::NoKeyId), Some(&2));
    assert_eq!(out.look_alikes.get(&NotOurs::MarkerMismatch), Some(&1));
}

#[test]
fn a_charge_of_a_key_from_before_deployment_ids_is_still_ours() {
    let mut unmarked = intent("pi_a", Some(1), Some(10));
    unmarked.metadata.remove(METADATA_DEPLOYMENT_ID);
    let mut old_ride = ride(1, Some(10), None);
    old_ride.deployment_id = None;
    let ledger = ledger(vec![unmarked.clone()], vec![old_ride]);
    assert_eq!(kinds(&classify(&ledger)), [FindingKind::UnrecordedCharge]);
    // The same unmarked charge naming a ride created under a deployment id is not ours.
    let ledger = ledger_of(vec![unmarked], vec![ride(1, Some(10), None)]);
    assert_eq!(kinds(&classify(&ledger)), []);
}

#[test]
fn unsuccessful_intents_are_left_alone() {
    let mut declined = intent("pi_d", Some(1), Some(10));
    declined.status = "requires_payment_method".to_owned();
    let out = classify(&ledger(vec![declined], vec![ride(1, Some(10), None)]));
    assert_eq!(kinds(&out), []);
    assert_eq!(out.foreign, 0);
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
fn a_refunded_charge_a_ride_records_is_reported() {
    let mut refunded = intent("pi_a", Some(1), Some(10));
    refunded.latest_charge = Some(provider::LatestCharge::Expanded {
        id: "ch_a".to_owned(),
        amount_refunded: 500,
    });
    let out = classify(&ledger(
        vec![refunded],
        vec![ride(1, Some(10), Some("pi_a"))],
    ));
    assert_eq!(kinds(&out), [FindingKind::RefundedCharge]);
    assert!(!FindingKind::RefundedCharge.is_refundable());
    assert_eq!(out.matched, 0);
}

#[test]
fn over_long_values_make_a_finding_of_their_own_cut_to_fit() {
    let mut long_id = intent(&"p".repeat(300), Some(1), Some(10));
    long_id.status = "s".repeat(70);
    let mut long_currency = intent("pi_c", Some(1), Some(10));
    long_currency.currency = "c".repeat(17);
    let out = classify(&ledger(
        vec![long_id, long_currency, intent("pi_ok", Some(1), Some(10))],
        vec![ride(1, Some(10), Some("pi_ok"))],
    ));
    assert_eq!(
        kinds(&out),
        [FindingKind::OversizedValue, FindingKind::OversizedValue]
    );
    let id = &out.findings[0].payment_intent_id;
    assert_eq!(id.chars().count(), MAX_ID);
    assert!(id.ends_with("…(300 chars)"), "{id}");
    assert_eq!(
        out.findings[0].provider_status.as_deref().map(str::len),
        Some(MAX_STATUS)
    );
    assert_eq!(
        out.findings[1].provider_currency.as_deref().map(str::len),
        Some(MAX_CURRENCY)
    );
    assert_eq!(out.matched, 1, "the rest of the window is still compared");
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
