//! The invariants of the run as a whole: the api-servers' exits, the provider's ledger and the
//! mail against the rides, and the reconciler's findings.

use std::collections::{BTreeMap, HashSet};

use crate::args::Args;

use super::*;

impl Checks<'_> {
    /// Crash points: every one fired, and the api-servers died of nothing else; and no receipt
    /// claim was left unresolved.
    pub(super) fn exits(
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
    pub(super) fn ledger_and_mail(&self, v: &mut Violations) {
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
    pub(super) fn reconciliation(&self, v: &mut Violations) {
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
