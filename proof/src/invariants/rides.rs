//! The invariants of each ride: a charged ride's PaymentIntent, receipt and mail; a declined
//! ride's absence of all three.

use crate::evidence::RideRow;

use super::*;

impl Checks<'_> {
    /// Per-ride receipt/charge checks for a ride that must be charged exactly once.
    pub(super) fn charged_ride(
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

    pub(super) fn declined_ride(&self, v: &mut Violations, key: &str, ride: &RideRow) {
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
}
