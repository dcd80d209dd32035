//! The invariants of each key a client made: what it saw against what the database holds, for
//! keys that succeeded, declined or were abandoned.

use std::collections::BTreeMap;

use crate::{
    clients::{KeyRecord, Seen},
    evidence::{KeyRow, RideRow},
};

use super::*;

impl Checks<'_> {
    /// Per key, by what the client finally saw: the outcomes, and how the abandoned keys were
    /// resolved.
    pub(super) fn keys(
        &self,
        v: &mut Violations,
    ) -> (BTreeMap<String, u64>, BTreeMap<&'static str, u64>) {
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
                        eprintln!(
                            "proof: note: key {} (key_id {}) client gave up ({why})",
                            r.key,
                            row.map_or_else(|| "-".to_owned(), |k| k.id.to_string())
                        );
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
    pub(super) fn ok_key(
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
    pub(super) fn declined_key(&self, v: &mut Violations, r: &KeyRecord, key_rides: &[&RideRow]) {
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
    pub(super) fn abandoned_key(
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
}
