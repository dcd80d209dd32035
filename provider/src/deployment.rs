//! The deployment id (`DEPLOYMENT_ID`): which installation of Rocket Rides made a provider object.
//! Several environments or products usually share one Stripe account, and a database restored
//! from a backup reuses ids, so every provider idempotency key and every PaymentIntent's metadata
//! carry it (docs/money-safety.md). Read with the provider's other variables, by every binary
//! that talks to the provider.

use std::fmt;

use crate::InvalidVariable;

/// What a local run against fake-stripe uses when `DEPLOYMENT_ID` is unset. Refused against the
/// real Stripe ([`DeploymentId::from_lookup`]), so two real environments never share it.
pub const DEVELOPMENT_DEPLOYMENT_ID: &str = "dev";

/// The longest deployment id: it goes into every provider idempotency key (Stripe allows 255
/// characters) and into a database column of the same bound.
pub const MAX_DEPLOYMENT_ID_LEN: usize = 24;

/// The first segment of every provider refund key after `rocket-rides-`; no deployment id may
/// start with it.
pub const REFUND_SEGMENT: &str = "refund";

/// A validated deployment id: 1 to 24 characters of `[a-z0-9-]`, starting with a letter or a
/// digit (the `idempotency_keys.deployment_id` CHECK says the same), and whose first
/// `-`-separated segment is not `refund`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeploymentId(String);

impl DeploymentId {
    pub fn parse(value: &str) -> Result<DeploymentId, String> {
        let valid_chars = value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if value.is_empty() || value.len() > MAX_DEPLOYMENT_ID_LEN {
            return Err(format!(
                "must be 1 to {MAX_DEPLOYMENT_ID_LEN} characters, is {}",
                value.len()
            ));
        }
        if !valid_chars || value.starts_with('-') {
            return Err(format!(
                "{value:?} must be lowercase letters, digits and '-', not starting with '-'"
            ));
        }
        // Charge keys are `rocket-rides-{id}-{key}` and refund keys `rocket-rides-refund-…`
        // (`contract::key`): an id whose first segment is `refund` would make a charge key equal
        // to another deployment's refund key, and the provider would answer one with the other.
        if value.split('-').next() == Some(REFUND_SEGMENT) {
            return Err(format!(
                "{value:?} must not start with {REFUND_SEGMENT:?}: that prefix names refunds in \
                 provider idempotency keys"
            ));
        }
        Ok(DeploymentId(value.to_owned()))
    }

    /// `DEPLOYMENT_ID` through `lookup` (empty counts as unset). Unset is allowed only against
    /// fake-stripe: when the secret key is a live one (`sk_live_`, `rk_live_`) or the API base is
    /// Stripe's own (`api.stripe.com`), the id must be set, so that no two real environments fall
    /// back to the same one.
    pub fn from_lookup(
        lookup: &dyn Fn(&str) -> Option<String>,
        api_base: &str,
        secret_key: &str,
    ) -> Result<DeploymentId, InvalidVariable> {
        let invalid = |reason: String| InvalidVariable {
            name: "DEPLOYMENT_ID",
            reason,
        };
        match lookup("DEPLOYMENT_ID").filter(|value| !value.is_empty()) {
            Some(value) => DeploymentId::parse(value.trim()).map_err(invalid),
            None if is_real_stripe(api_base, secret_key) => Err(invalid(format!(
                "it is required against the real Stripe ({api_base}); the development default \
                 {DEVELOPMENT_DEPLOYMENT_ID:?} is only for fake-stripe"
            ))),
            None => Ok(DeploymentId(DEVELOPMENT_DEPLOYMENT_ID.to_owned())),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DeploymentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether the configuration talks to Stripe itself (any mode) or with a live key.
pub(crate) fn is_real_stripe(api_base: &str, secret_key: &str) -> bool {
    let host = api_base
        .split("://")
        .nth(1)
        .unwrap_or(api_base)
        .split(['/', ':'])
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    host == "stripe.com"
        || host.ends_with(".stripe.com")
        || secret_key.starts_with("sk_live_")
        || secret_key.starts_with("rk_live_")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(value: Option<&str>, base: &str, key: &str) -> Result<DeploymentId, InvalidVariable> {
        let value = value.map(str::to_owned);
        DeploymentId::from_lookup(&|_| value.clone(), base, key)
    }

    #[test]
    fn ids_are_short_lowercase_and_dashes() {
        for good in ["dev", "prod-eu-1", "0", &"a".repeat(24)] {
            assert!(DeploymentId::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "Prod",
            "prod_eu",
            "-prod",
            "pröd",
            "a b",
            &"a".repeat(25),
            "refund",
            "refund-prod",
        ] {
            assert!(DeploymentId::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn unset_defaults_to_dev_only_against_fake_stripe() {
        let fake = "http://127.0.0.1:12111";
        assert_eq!(
            read(None, fake, "sk_test_x").unwrap().as_str(),
            DEVELOPMENT_DEPLOYMENT_ID
        );
        assert_eq!(
            read(Some(""), "http://fake-stripe:12111", "sk_test_x")
                .unwrap()
                .as_str(),
            "dev"
        );
        assert!(read(None, "https://api.stripe.com", "sk_test_x").is_err());
        assert!(read(None, "https://API.Stripe.com:443/", "sk_test_x").is_err());
        assert!(read(None, fake, "sk_live_x").is_err());
        assert!(read(None, fake, "rk_live_x").is_err());
        assert_eq!(
            read(Some("prod-eu"), "https://api.stripe.com", "sk_live_x")
                .unwrap()
                .as_str(),
            "prod-eu"
        );
        assert!(read(Some("PROD"), fake, "sk_test_x").is_err());
    }
}
