//! Which PaymentIntents are ours: the one rule the api-server's charge search and the workers'
//! reconciler both apply before acting on a provider object (docs/money-safety.md). The provider
//! account is shared with other products and environments, and metadata is free text anyone with
//! the key can write, so no single field proves anything. A PaymentIntent is ours only if
//! - its key id (`metadata[idempotency_key_id]`) names an idempotency key in our database;
//! - its deployment marker (`metadata[deployment_id]`) is that key's deployment id, and that is
//!   this installation's (a key from before deployment ids has none, and so has its charge);
//! - its `metadata[ride_id]` is that key's ride, its customer that key's user's Stripe customer,
//!   and its amount and currency that ride's.
//!
//! Everything else is not ours: callers ignore it and count it, and never refund or record it.
//! Pure: the callers gather the facts (each in its own way), the decision is made here.

use std::collections::BTreeMap;

/// The metadata keys the api-server puts on every charge (a key created before deployment ids
/// has no `deployment_id`).
pub const METADATA_DEPLOYMENT_ID: &str = "deployment_id";
pub const METADATA_RIDE_ID: &str = "ride_id";
pub const METADATA_USER_ID: &str = "user_id";
pub const METADATA_KEY_ID: &str = "idempotency_key_id";

/// What a PaymentIntent says about itself.
#[derive(Clone, Copy, Debug)]
pub struct IntentFacts<'a> {
    pub metadata: &'a BTreeMap<String, String>,
    pub customer: Option<&'a str>,
    pub amount: i64,
    pub currency: &'a str,
}

/// What our database says about the key a PaymentIntent names ([`key_id`]), with its ride and
/// its user's Stripe customer.
#[derive(Clone, Copy, Debug)]
pub struct KeyRecord<'a> {
    pub key_id: i64,
    /// The key row's `deployment_id` (`None`: created before deployment ids).
    pub deployment_id: Option<&'a str>,
    pub customer: &'a str,
    pub ride_id: i64,
    pub amount: i64,
    pub currency: &'a str,
}

/// Why a PaymentIntent is not ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NotOurs {
    /// No readable `metadata[idempotency_key_id]`.
    NoKeyId,
    /// The key id names no key of ours (another system's number, or a reaped key).
    UnknownKey,
    /// The deployment marker is not the key's (another environment, or a forged key id).
    MarkerMismatch,
    /// The key was created by another deployment (a database restored under a new id).
    OtherDeployment,
    RideMismatch,
    CustomerMismatch,
    AmountMismatch,
    CurrencyMismatch,
}

impl NotOurs {
    pub fn as_str(self) -> &'static str {
        match self {
            NotOurs::NoKeyId => "no_key_id",
            NotOurs::UnknownKey => "unknown_key",
            NotOurs::MarkerMismatch => "marker_mismatch",
            NotOurs::OtherDeployment => "other_deployment",
            NotOurs::RideMismatch => "ride_mismatch",
            NotOurs::CustomerMismatch => "customer_mismatch",
            NotOurs::AmountMismatch => "amount_mismatch",
            NotOurs::CurrencyMismatch => "currency_mismatch",
        }
    }
}

impl std::fmt::Display for NotOurs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The key id a PaymentIntent names: what the caller looks up to build the [`KeyRecord`].
pub fn key_id(metadata: &BTreeMap<String, String>) -> Option<i64> {
    metadata_id(metadata, METADATA_KEY_ID)
}

/// A positive decimal id from `metadata[name]` (nothing else reads as one: no sign, no spaces).
pub fn metadata_id(metadata: &BTreeMap<String, String>, name: &str) -> Option<i64> {
    let value = metadata.get(name)?;
    if value.is_empty() || value.len() > 19 || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok().filter(|id| *id > 0)
}

/// Whether the PaymentIntent carries this deployment's marker (a claim to be ours, which the
/// rest of the rule may still refute).
pub fn carries_marker(metadata: &BTreeMap<String, String>, deployment_id: &str) -> bool {
    metadata.get(METADATA_DEPLOYMENT_ID).map(String::as_str) == Some(deployment_id)
}

/// The rule: `Ok` if the PaymentIntent is ours. `key` is the key [`key_id`] names, looked up in
/// our database (`None` if it names none); `deployment_id` is this installation's.
pub fn verdict(
    deployment_id: &str,
    intent: &IntentFacts<'_>,
    key: Option<&KeyRecord<'_>>,
) -> Result<(), NotOurs> {
    let named = key_id(intent.metadata).ok_or(NotOurs::NoKeyId)?;
    let key = key
        .filter(|key| key.key_id == named)
        .ok_or(NotOurs::UnknownKey)?;
    let marker = intent
        .metadata
        .get(METADATA_DEPLOYMENT_ID)
        .map(String::as_str);
    if marker != key.deployment_id {
        return Err(NotOurs::MarkerMismatch);
    }
    if key.deployment_id.is_some_and(|id| id != deployment_id) {
        return Err(NotOurs::OtherDeployment);
    }
    if metadata_id(intent.metadata, METADATA_RIDE_ID) != Some(key.ride_id) {
        return Err(NotOurs::RideMismatch);
    }
    if intent.customer != Some(key.customer) {
        return Err(NotOurs::CustomerMismatch);
    }
    if intent.amount != key.amount {
        return Err(NotOurs::AmountMismatch);
    }
    if !intent.currency.eq_ignore_ascii_case(key.currency) {
        return Err(NotOurs::CurrencyMismatch);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn ours() -> BTreeMap<String, String> {
        metadata(&[
            (METADATA_DEPLOYMENT_ID, "prod"),
            (METADATA_KEY_ID, "10"),
            (METADATA_RIDE_ID, "5"),
            (METADATA_USER_ID, "7"),
        ])
    }

    fn key(deployment_id: Option<&str>) -> KeyRecord<'_> {
        KeyRecord {
            key_id: 10,
            deployment_id,
            customer: "cus_a",
            ride_id: 5,
            amount: 2000,
            currency: "usd",
        }
    }

    fn intent(metadata: &BTreeMap<String, String>) -> IntentFacts<'_> {
        IntentFacts {
            metadata,
            customer: Some("cus_a"),
            amount: 2000,
            currency: "usd",
        }
    }

    #[test]
    fn a_charge_is_ours_only_when_every_part_matches() {
        let ours = ours();
        let key = key(Some("prod"));
        assert_eq!(verdict("prod", &intent(&ours), Some(&key)), Ok(()));
        assert_eq!(
            verdict("staging", &intent(&ours), Some(&key)),
            Err(NotOurs::OtherDeployment)
        );
        assert_eq!(
            verdict("prod", &intent(&ours), None),
            Err(NotOurs::UnknownKey)
        );
        let other_key = KeyRecord { key_id: 11, ..key };
        assert_eq!(
            verdict("prod", &intent(&ours), Some(&other_key)),
            Err(NotOurs::UnknownKey)
        );
        let cases: [(IntentFacts<'_>, NotOurs); 3] = [
            (
                IntentFacts {
                    customer: Some("cus_b"),
                    ..intent(&ours)
                },
                NotOurs::CustomerMismatch,
            ),
            (
                IntentFacts {
                    amount: 2001,
                    ..intent(&ours)
                },
                NotOurs::AmountMismatch,
            ),
            (
                IntentFacts {
                    currency: "eur",
                    ..intent(&ours)
                },
                NotOurs::CurrencyMismatch,
            ),
        ];
        for (facts, why) in cases {
            assert_eq!(verdict("prod", &facts, Some(&key)), Err(why));
        }
        assert_eq!(
            verdict(
                "prod",
                &IntentFacts {
                    customer: None,
                    ..intent(&ours)
                },
                Some(&key)
            ),
            Err(NotOurs::CustomerMismatch)
        );
    }

    #[test]
    fn look_alike_metadata_proves_nothing() {
        let key = key(Some("prod"));
        // The three look-alikes: a bare user_id, a ride id of ours, a key id of ours.
        for pairs in [
            &[(METADATA_USER_ID, "7")][..],
            &[(METADATA_RIDE_ID, "5")][..],
            &[(METADATA_KEY_ID, "10")][..],
            &[(METADATA_KEY_ID, "10"), (METADATA_RIDE_ID, "5")][..],
            &[(METADATA_KEY_ID, "+10"), (METADATA_RIDE_ID, "5")][..],
        ] {
            let metadata = metadata(pairs);
            assert!(
                verdict("prod", &intent(&metadata), Some(&key)).is_err(),
                "{pairs:?}"
            );
        }
        let mut wrong_ride = ours();
        wrong_ride.insert(METADATA_RIDE_ID.into(), "6".into());
        assert_eq!(
            verdict("prod", &intent(&wrong_ride), Some(&key)),
            Err(NotOurs::RideMismatch)
        );
        let mut other_env = ours();
        other_env.insert(METADATA_DEPLOYMENT_ID.into(), "staging".into());
        assert_eq!(
            verdict("prod", &intent(&other_env), Some(&key)),
            Err(NotOurs::MarkerMismatch)
        );
    }

    #[test]
    fn a_key_from_before_deployment_ids_matches_only_an_unmarked_charge() {
        let legacy = key(None);
        let mut unmarked = ours();
        unmarked.remove(METADATA_DEPLOYMENT_ID);
        assert_eq!(verdict("prod", &intent(&unmarked), Some(&legacy)), Ok(()));
        assert_eq!(
            verdict("prod", &intent(&ours()), Some(&legacy)),
            Err(NotOurs::MarkerMismatch)
        );
        assert_eq!(
            verdict("prod", &intent(&unmarked), Some(&key(Some("prod")))),
            Err(NotOurs::MarkerMismatch)
        );
    }

    #[test]
    fn ids_are_plain_positive_decimals() {
        let read = |value: &str| metadata_id(&metadata(&[("x", value)]), "x");
        assert_eq!(read("42"), Some(42));
        for bad in ["", "0", "-1", "+1", " 1", "1e3", "99999999999999999999"] {
            assert_eq!(read(bad), None, "{bad}");
        }
        assert!(carries_marker(&ours(), "prod"));
        assert!(!carries_marker(&ours(), "prod-2"));
    }
}
