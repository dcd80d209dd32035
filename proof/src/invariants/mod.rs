//! The invariants: exactly-once charging and receipting, checked key by key against what its
//! client saw and the evidence (database, ledger, mail), then globally (no charge, receipt or
//! mail without its ride, every crash point fired). Each violation names its invariant and the
//! offending key, so that one failed run says what broke and where to look. The checks are
//! methods of `Checks`, by what they look at: `rides.rs`, `keys.rs`, `ledger.rs` (the run as a
//! whole); `rolling.rs` and `failover.rs` hold the goals of `--rolling` and `--ha`.

use std::collections::{BTreeMap, HashMap};

use crate::{
    args::Args,
    clients::{KeyRecord, User},
    counters::Counters,
    evidence::{self, Evidence, Intent, KeyRow, RideRow},
    processes::Arming,
    replays::Replays,
};

pub(crate) mod failover;
mod keys;
mod ledger;
mod rides;
pub(crate) mod rolling;

/// Every invariant the campaign checks, by id, with what it means (the report's lines).
pub(crate) const INVARIANTS: [(&str, &str); 37] = [
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
        "live_replay_identical",
        "replays sent during traffic are the first answer to the byte, marked",
    ),
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
    // `--rolling`'s (rolling.rs).
    (
        "rolling_every_call_answered",
        "--rolling: every call ended with a final answer (a ride or a decline)",
    ),
    (
        "rolling_no_internal",
        "--rolling: no attempt was answered INTERNAL",
    ),
    (
        "rolling_replaced",
        "--rolling: every api-server and worker replaced --rollouts times, each exiting in its grace",
    ),
    (
        "rolling_drained",
        "--rolling: each api-server logged its shutdown and drain on every rollout",
    ),
    // `--ha`'s (failover.rs).
    (
        "ha_primary_kills",
        "--ha: at least --ha-min-primary-kills primary kills",
    ),
    (
        "ha_fresh_outage",
        "--ha: fresh CreateRides unavailable <= 5 s at p99, <= 10 s at worst per primary kill",
    ),
    (
        "ha_replay_outage",
        "--ha: replays unavailable no longer than fresh work (within 1 s) per primary or broker kill",
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

    /// The first `n` violations of `invariant`, as [`Violations::add`] listed them.
    pub(crate) fn first_of<'a>(
        &'a self,
        invariant: &str,
        n: usize,
    ) -> impl Iterator<Item = &'a str> + 'a {
        let prefix = format!("[{invariant}] ");
        self.list
            .iter()
            .filter(move |line| line.starts_with(&prefix))
            .take(n)
            .map(String::as_str)
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
}

#[cfg(test)]
mod violations_tests {
    use super::Violations;

    #[test]
    fn first_of_lists_one_invariants_violations_in_order_up_to_n() {
        let mut v = Violations::default();
        v.add("money_exercised", "no refund was made".into());
        v.add("no_paid_after_refund", "key a answered OK".into());
        v.add(
            "money_exercised",
            "refunded key b answered last None".into(),
        );
        v.add(
            "money_exercised",
            "refunded key c answered last None".into(),
        );
        let first: Vec<&str> = v.first_of("money_exercised", 2).collect();
        assert_eq!(
            first,
            [
                "[money_exercised] no refund was made",
                "[money_exercised] refunded key b answered last None"
            ]
        );
        assert_eq!(v.first_of("refunds_audited", 3).count(), 0);
    }
}
