//! The invariants: exactly-once charging and receipting, checked key by key against what its
//! client saw and the evidence (database, ledger, mail), then globally (no charge, receipt or
//! mail without its ride, every crash point fired). Each violation names its invariant and the
//! offending key, so that one failed run says what broke and where to look.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::{
    args::Args,
    clients::{KeyRecord, Seen, User},
    counters::Counters,
    evidence::{self, Evidence, Intent, KeyRow, RideRow},
    processes::Arming,
    replays::Replays,
};

/// Every invariant the campaign checks, by id, with what it means (the report's lines).
pub(crate) const INVARIANTS: [(&str, &str); 29] = [
    (
        "ok_key_finished",
        "every key a client saw succeed is finished",
    ),
    ("one_ride", "exactly one ride per key"),
    (
        "client_saw_ride",
        "the ride the client saw is the ride in the database",
    ),
    (
        "one_succeeded_pi",
        "exactly one succeeded PaymentIntent per charged ride",
    ),
    (
        "client_saw_pi",
        "the charge the client saw is the one in the ledger",
    ),
    (
        "ride_records_pi",
        "the ride records the ledger's PaymentIntent",
    ),
    (
        "one_receipt",
        "exactly one receipt (staged or sent) per charged ride, all drained",
    ),
    (
        "one_mail",
        "exactly one mail per charged ride, no claim left",
    ),
    (
        "crash_points_fired",
        "every api-server crash point fired at least once",
    ),
    (
        "no_unexpected_exit",
        "api-servers exited only at crash points or by our kills",
    ),
    (
        "no_double_charge",
        "no ride has two succeeded PaymentIntents",
    ),
    ("pi_has_ride", "no succeeded PaymentIntent without its ride"),
    ("mail_has_ride", "no mail for an unknown ride"),
    (
        "abandoned_resolved",
        "every abandoned key is finished or in keys_needing_attention",
    ),
    (
        "replay_identical",
        "replays are byte-identical to the first final answer",
    ),
    ("replay_marked", "replays carry idempotent-replayed: true"),
    ("replay_final", "finished keys replay a final answer"),
    (
        "declined_once",
        "declined rides: at most one PaymentIntent, none succeeded",
    ),
    (
        "declined_no_receipt",
        "declined rides: no charge id, receipt or mail",
    ),
    ("declining_card_never_ok", "declining cards never succeed"),
    ("good_card_never_declined", "good cards are never declined"),
    (
        "no_unexpected_answer",
        "no non-retryable error other than CARD_DECLINED",
    ),
    (
        "reconciled",
        "the reconciler finds exactly the unrecorded charges of keys needing attention",
    ),
    // The money campaign's (crate::money_checks).
    (
        "no_foreign_refund",
        "no refund of a charge that is not ours",
    ),
    (
        "no_foreign_recorded",
        "no ride records, no refundable finding names, another product's charge",
    ),
    ("no_paid_after_refund", "no ride paid after its refund"),
    (
        "refunds_audited",
        "every refund audited (one refund_audits row per provider refund)",
    ),
    (
        "no_receipt_unrecorded",
        "no receipt for an unrecorded charge",
    ),
    (
        "money_exercised",
        "the money campaign refunded, retried refunded keys and forged receipts",
    ),
];

/// A key the reconciler refunded, finished with the stored outcome `payment_refunded`: it
/// replays PAYMENT_REFUNDED (the money invariants check that its ride was never paid).
fn refunded(row: Option<&KeyRow>) -> bool {
    row.and_then(|k| k.outcome.as_deref()) == Some("payment_refunded")
}

/// The answer of a refunded key (rides-client's label).
pub(crate) fn is_payment_refunded(label: &str) -> bool {
    label.ends_with("/PAYMENT_REFUNDED")
}

#[derive(Default)]
pub(crate) struct Violations {
    pub(crate) list: Vec<String>,
    pub(crate) by_invariant: BTreeMap<&'static str, u64>,
}

impl Violations {
    pub(crate) fn add(&mut self, invariant: &'static str, what: String) {
        *self.by_invariant.entry(invariant).or_default() += 1;
        if self.list.len() < 500 {
            eprintln!("VIOLATION [{invariant}] {what}");
        }
        self.list.push(format!("[{invariant}] {what}"));
    }
}

/// What the invariants are checked against: what the clients and the replays saw, and the
/// evidence.
pub(crate) struct Facts<'a> {
    pub(crate) records: &'a [KeyRecord],
    pub(crate) users: &'a [User],
    pub(crate) evidence: &'a Evidence,
    pub(crate) replays: &'a Replays,
}

/// The violations, and the tallies the checks made on the way.
pub(crate) struct Verdict {
    pub(crate) violations: Violations,
    /// Keys by what the client finally saw.
    pub(crate) outcomes: BTreeMap<String, u64>,
    /// Abandoned and given-up keys, by how the system resolved them.
    pub(crate) abandoned: BTreeMap<&'static str, u64>,
    pub(crate) crash_points_fired: BTreeMap<String, u64>,
}

/// Checks every invariant; `v` holds the replays' violations already.
pub(crate) fn judge(
    args: &Args,
    facts: &Facts,
    arming: &Arming,
    faults: &Counters,
    mut v: Violations,
) -> Verdict {
    let checks = Checks::index(facts, &mut v);
    let (outcomes, abandoned) = checks.keys(&mut v);
    let crash_points_fired = arming.fired();
    checks.exits(args, &crash_points_fired, &faults.snapshot(), &mut v);
    checks.ledger_and_mail(&mut v);
    checks.reconciliation(&mut v);
    Verdict {
        violations: v,
        outcomes,
        abandoned,
        crash_points_fired,
    }
}

/// The facts, indexed for the checks.
struct Checks<'a> {
    facts: &'a Facts<'a>,
    ev: &'a Evidence,
    key_by_name: HashMap<(i64, String), &'a KeyRow>,
    token_of: HashMap<i64, &'a User>,
    rides_by_key: HashMap<i64, Vec<&'a RideRow>>,
    ride_by_id: HashMap<i64, &'a RideRow>,
    succeeded_by_ride: HashMap<i64, Vec<&'a Intent>>,
    all_by_ride: HashMap<i64, Vec<&'a Intent>>,
}

impl<'a> Checks<'a> {
    /// Indexes; a PaymentIntent without a ride is a violation already.
    fn index(facts: &'a Facts<'a>, v: &mut Violations) -> Self {
        let ev = facts.evidence;
        let rides_by_key: HashMap<i64, Vec<&RideRow>> =
            ev.rides.iter().fold(HashMap::new(), |mut m, r| {
                if let Some(k) = r.idempotency_key_id {
                    m.entry(k).or_insert_with(Vec::new).push(r);
                }
                m
            });
        let ride_by_id: HashMap<i64, &RideRow> = ev.rides.iter().map(|r| (r.id, r)).collect();
        let mut succeeded_by_ride: HashMap<i64, Vec<&Intent>> = HashMap::new();
        let mut all_by_ride: HashMap<i64, Vec<&Intent>> = HashMap::new();
        for pi in &ev.ledger {
            match pi.ride_id {
                Some(ride) => {
                    all_by_ride.entry(ride).or_default().push(pi);
                    if pi.status == "succeeded" {
                        succeeded_by_ride.entry(ride).or_default().push(pi);
                    }
                }
                None => v.add(
                    "pi_has_ride",
                    format!("PaymentIntent {} has no metadata[ride_id]", pi.id),
                ),
            }
        }
        Checks {
            facts,
            ev,
            key_by_name: evidence::by_name(&ev.keys),
            token_of: facts.users.iter().map(|u| (u.id, u)).collect(),
            rides_by_key,
            ride_by_id,
            succeeded_by_ride,
            all_by_ride,
        }
    }

    /// Per-ride receipt/charge checks for a ride that must be charged exactly once.
    fn charged_ride(
        &self,
        v: &mut Violations,
        key: &str,
        ride: &RideRow,
        expected_pi: Option<&str>,
    ) {
        let succeeded = self
            .succeeded_by_ride
            .get(&ride.id)
            .map_or(&[][..], Vec::as_slice);
        if succeeded.len() != 1 {
            v.add(
                "one_succeeded_pi",
                format!(
                    "key {key}: ride {} has {} succeeded PaymentIntents",
                    ride.id,
                    succeeded.len()
                ),
            );
        }
        if let Some(pi) = succeeded.first() {
            if ride.stripe_charge_id.as_deref() != Some(pi.id.as_str()) {
                v.add(
                    "ride_records_pi",
                    format!(
                        "key {key}: ride {} charge {:?} but PI {}",
                        ride.id, ride.stripe_charge_id, pi.id
                    ),
                );
            }
            if let Some(expected) = expected_pi
                && expected != pi.id
            {
                v.add(
                    "client_saw_pi",
                    format!(
                        "key {key}: client saw charge {expected}, ledger has {}",
                        pi.id
                    ),
                );
            }
        }
        let staged = self
            .ev
            .staged_rides
            .iter()
            .filter(|r| **r == ride.id)
            .count();
        let receipt = staged + usize::from(self.ev.sent_receipts.contains(&ride.id));
        if receipt != 1 || staged != 0 {
            v.add(
                "one_receipt",
                format!(
                    "key {key}: ride {}: staged {staged}, sent_receipts {} (want exactly one, mailed)",
                    ride.id,
                    self.ev.sent_receipts.contains(&ride.id)
                ),
            );
        }
        let mails = self.ev.mail.get(&ride.id).map_or(&[][..], Vec::as_slice);
        if mails.len() != 1 {
            v.add(
                "one_mail",
                format!("key {key}: ride {} has {} mails", ride.id, mails.len()),
            );
        }
    }

    fn declined_ride(&self, v: &mut Violations, key: &str, ride: &RideRow) {
        let all = self.all_by_ride.get(&ride.id).map_or(0, Vec::len);
        let ok = self.succeeded_by_ride.get(&ride.id).map_or(0, Vec::len);
        if all > 1 || ok > 0 {
            v.add(
                "declined_once",
                format!(
                    "key {key}: declined ride {} has {all} PaymentIntents ({ok} succeeded)",
                    ride.id
                ),
            );
        }
        if ride.stripe_charge_id.is_some()
            || self.ev.sent_receipts.contains(&ride.id)
            || self.ev.mail.contains_key(&ride.id)
        {
            v.add(
                "declined_no_receipt",
                format!(
                    "key {key}: declined ride {} has a charge id, receipt or mail",
                    ride.id
                ),
            );
        }
    }

    /// Per key, by what the client finally saw: the outcomes, and how the abandoned keys were
    /// resolved.
    fn keys(&self, v: &mut Violations) -> (BTreeMap<String, u64>, BTreeMap<&'static str, u64>) {
        let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
        let mut abandoned_resolution: BTreeMap<&'static str, u64> = BTreeMap::new();
        for r in self.facts.records {
            *outcomes.entry(r.seen.kind().to_owned()).or_default() += 1;
            let row = self.key_by_name.get(&(r.user_id, r.key.clone())).copied();
            let key_rides = row
                .and_then(|k| self.rides_by_key.get(&k.id))
                .map_or(&[][..], Vec::as_slice);
            match &r.seen {
                Seen::Ok {
                    ride_id, charge_id, ..
                } => self.ok_key(v, r, row, key_rides, *ride_id, charge_id),
                Seen::Declined { .. } => self.declined_key(v, r, key_rides),
                Seen::Abandoned(_) | Seen::GaveUp(_) => {
                    let resolution = self.abandoned_key(v, r, row, key_rides);
                    if let Some(resolution) = resolution {
                        *abandoned_resolution.entry(resolution).or_default() += 1;
                    }
                    if let Seen::GaveUp(why) = &r.seen {
                        eprintln!("proof: note: key {} client gave up ({why})", r.key);
                    }
                }
                Seen::Unexpected(label) if is_payment_refunded(label) && refunded(row) => {}
                Seen::Unexpected(label) => {
                    v.add("no_unexpected_answer", format!("key {}: {label}", r.key))
                }
            }
        }
        (outcomes, abandoned_resolution)
    }

    /// A key whose client saw OK: finished, with exactly the ride and charge the client saw.
    fn ok_key(
        &self,
        v: &mut Violations,
        r: &KeyRecord,
        row: Option<&KeyRow>,
        key_rides: &[&RideRow],
        ride_id: i64,
        charge_id: &str,
    ) {
        if self.token_of.get(&r.user_id).is_some_and(|u| u.declining) {
            v.add(
                "declining_card_never_ok",
                format!("key {}: declining card succeeded", r.key),
            );
        }
        match row {
            Some(k) if k.recovery_point == "finished" => {}
            _ => v.add(
                "ok_key_finished",
                format!(
                    "key {}: client saw OK but key is {:?}",
                    r.key,
                    row.map(|k| &k.recovery_point)
                ),
            ),
        }
        if key_rides.len() != 1 {
            v.add(
                "one_ride",
                format!("key {}: {} rides", r.key, key_rides.len()),
            );
        }
        match key_rides.first() {
            Some(ride) => {
                if ride.user_id != r.user_id {
                    v.add(
                        "client_saw_ride",
                        format!(
                            "key {}: ride {} belongs to user {}",
                            r.key, ride.id, ride.user_id
                        ),
                    );
                }
                if ride.id != ride_id {
                    v.add(
                        "client_saw_ride",
                        format!(
                            "key {}: client saw ride {ride_id}, DB has {}",
                            r.key, ride.id
                        ),
                    );
                }
                self.charged_ride(v, &r.key, ride, Some(charge_id));
            }
            None => v.add(
                "one_ride",
                format!("key {}: client saw ride {ride_id}, no ride in DB", r.key),
            ),
        }
    }

    /// A key whose client saw CARD_DECLINED: a good card never is, and the ride is never charged.
    fn declined_key(&self, v: &mut Violations, r: &KeyRecord, key_rides: &[&RideRow]) {
        if !self.token_of.get(&r.user_id).is_some_and(|u| u.declining) {
            v.add(
                "good_card_never_declined",
                format!("key {}: good card declined", r.key),
            );
        }
        match key_rides.first() {
            Some(ride) => self.declined_ride(v, &r.key, ride),
            None => v.add(
                "one_ride",
                format!("key {}: declined but no ride row", r.key),
            ),
        }
    }

    /// A key its client abandoned or gave up on: finished by the system (and then checked by its
    /// replay, like an answered key) or listed for attention. Returns how it was resolved, if it
    /// was.
    fn abandoned_key(
        &self,
        v: &mut Violations,
        r: &KeyRecord,
        row: Option<&KeyRow>,
        key_rides: &[&RideRow],
    ) -> Option<&'static str> {
        let listed = self.ev.attention_keys.contains(&(r.user_id, r.key.clone()));
        match row {
            None => Some("never_reached_the_database"),
            Some(_) if refunded(row) => Some("refunded_after_the_completer_gave_up"),
            Some(k) if k.recovery_point == "finished" => {
                match (self.facts.replays.seen.get(&r.key), key_rides.first()) {
                    (
                        Some(Seen::Ok {
                            ride_id, charge_id, ..
                        }),
                        Some(ride),
                    ) => {
                        if *ride_id != ride.id {
                            v.add(
                                "client_saw_ride",
                                format!("key {}: replay ride {ride_id}, DB {}", r.key, ride.id),
                            );
                        }
                        self.charged_ride(v, &r.key, ride, Some(charge_id));
                    }
                    (Some(Seen::Declined { .. }), Some(ride)) => {
                        self.declined_ride(v, &r.key, ride)
                    }
                    (other, ride) => v.add(
                        "abandoned_resolved",
                        format!(
                            "key {}: finished, replay {:?}, ride {:?}",
                            r.key,
                            other.map(Seen::kind),
                            ride.map(|r| r.id)
                        ),
                    ),
                }
                Some("finished_by_completer_or_server")
            }
            Some(_) if listed => Some("listed_in_keys_needing_attention"),
            Some(k) => {
                v.add(
                    "abandoned_resolved",
                    format!("key {} (user {}): unfinished at {} (gave_up {}) and not in keys_needing_attention", r.key, r.user_id, k.recovery_point, k.gave_up),
                );
                None
            }
        }
    }

    /// Crash points: every one fired, and the api-servers died of nothing else; and no receipt
    /// claim was left unresolved.
    fn exits(
        &self,
        args: &Args,
        crash_points_fired: &BTreeMap<String, u64>,
        fault_counts: &BTreeMap<String, u64>,
        v: &mut Violations,
    ) {
        if !args.no_crash_points {
            for point in api_server::fault::CrashPoint::ALL.map(|point| point.name()) {
                if !crash_points_fired.contains_key(point) {
                    v.add(
                        "crash_points_fired",
                        format!("crash point {point} never fired (is the api-server built with the fault-injection feature?)"),
                    );
                }
            }
        }
        let api_self_exits = fault_counts
            .get("self_exit/api-server")
            .copied()
            .unwrap_or(0)
            + fault_counts
                .get("self_exit/api-server-b")
                .copied()
                .unwrap_or(0);
        let crashes: u64 = crash_points_fired.values().sum();
        if api_self_exits > crashes {
            v.add(
                "no_unexpected_exit",
                format!("the api-servers exited {api_self_exits} times on their own but crash points fired {crashes} times: see logs/api-server*.log"),
            );
        }
        if self.ev.claims_left > 0 {
            v.add(
                "one_mail",
                format!("{} receipt claims were never resolved", self.ev.claims_left),
            );
        }
    }

    /// Global ledger checks, then every mail and every charged ride.
    fn ledger_and_mail(&self, v: &mut Violations) {
        for (ride, pis) in &self.succeeded_by_ride {
            if pis.len() > 1 {
                v.add(
                    "no_double_charge",
                    format!(
                        "ride {ride} charged {} times: {}",
                        pis.len(),
                        pis.iter()
                            .map(|p| p.id.as_str())
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                );
            }
            match self.ride_by_id.get(ride) {
                None => v.add(
                    "pi_has_ride",
                    format!("succeeded PI(s) for ride {ride} which does not exist"),
                ),
                Some(row) => {
                    let listed = row
                        .idempotency_key_id
                        .and_then(|id| self.ev.keys.iter().find(|k| k.id == id))
                        .is_some_and(|k| {
                            self.ev
                                .attention_keys
                                .contains(&(k.user_id, k.idempotency_key.clone()))
                        });
                    if row.stripe_charge_id.is_none() && !listed {
                        v.add("pi_has_ride", format!("ride {ride} was charged ({}) but records no charge and is not listed for attention", pis[0].id));
                    }
                }
            }
        }
        for (ride, stamps) in &self.ev.mail {
            if !self.ride_by_id.contains_key(ride) {
                v.add(
                    "mail_has_ride",
                    format!("{} mails for unknown ride {ride}", stamps.len()),
                );
            }
        }
        if self.ev.unparsed_mail > 0 {
            v.add(
                "mail_has_ride",
                format!("{} mails without a ride Message-ID", self.ev.unparsed_mail),
            );
        }
        for ride in &self.ev.rides {
            if ride.stripe_charge_id.is_some() && !self.succeeded_by_ride.contains_key(&ride.id) {
                v.add(
                    "ride_records_pi",
                    format!(
                        "ride {} records charge {:?} the ledger does not hold as succeeded",
                        ride.id, ride.stripe_charge_id
                    ),
                );
            }
        }
    }

    /// The reconciler's findings over the whole run: each must be an unrecorded charge of a key
    /// listed in keys_needing_attention (the completer could not finish it), and each such charge
    /// must have been found.
    fn reconciliation(&self, v: &mut Violations) {
        let found = &self.ev.reconciliation;
        if let Err(error) = &found.summary {
            v.add("reconciled", format!("the reconciler pass failed: {error}"));
        }
        let attention: HashSet<i64> = self
            .ev
            .attention
            .iter()
            .map(|a| a.idempotency_key_id)
            .collect();
        let foreign: HashSet<&str> = self.ev.foreign.iter().map(|pi| pi.id.as_str()).collect();
        // The other product's charges are the money invariants' to judge.
        for finding in found
            .findings
            .iter()
            .filter(|finding| !foreign.contains(finding.payment_intent_id.as_str()))
        {
            let expected = finding.kind == "unrecorded_charge"
                && finding
                    .idempotency_key_id
                    .is_some_and(|key| attention.contains(&key));
            if !expected {
                v.add(
                    "reconciled",
                    format!(
                        "unexpected finding #{} {} {} (ride {:?}, key {:?})",
                        finding.id,
                        finding.kind,
                        finding.payment_intent_id,
                        finding.ride_id,
                        finding.idempotency_key_id
                    ),
                );
            }
        }
        let unrecorded: HashSet<&str> = found
            .findings
            .iter()
            .filter(|finding| finding.kind == "unrecorded_charge")
            .map(|finding| finding.payment_intent_id.as_str())
            .collect();
        for (ride, pis) in &self.succeeded_by_ride {
            let Some(row) = self.ride_by_id.get(ride) else {
                continue;
            };
            for pi in pis {
                if row.stripe_charge_id.as_deref() != Some(pi.id.as_str())
                    && !unrecorded.contains(pi.id.as_str())
                {
                    v.add(
                        "reconciled",
                        format!(
                            "ride {ride}: charge {} is not the one it records ({:?}) and the \
                             reconciler did not find it",
                            pi.id, row.stripe_charge_id
                        ),
                    );
                }
            }
        }
    }
}
