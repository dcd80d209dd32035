//! The rules of an idempotency key that more than one process applies: the api-server's phases
//! and the completer act on keys, and `workers admin` inspects and finishes them by hand, so each
//! rule is stated here once.
//!
//! # Which commits wait for the WAL flush
//!
//! A commit must be durable (flushed, and with a synchronous standby, on the standby) before
//! anything outside the database acts on it: the provider charge, or an answer to a caller. Every
//! statement that moves a key on is followed by one of the two, so every such commit waits for
//! the flush (PostgreSQL's default, `synchronous_commit` on):
//!
//! | commit | next outside effect |
//! | --- | --- |
//! | the claim of a fresh key, which inserts it with its ride at `ride_created` (phase `started` merged into the claim) | the charge, keyed by the key's id |
//! | `ride_created` → `finished`: the charge recorded, the receipt staged, the outcome stored (phase `charge_created` merged into the charge's record) | the answer |
//! | → `finished` with a decline, or by an operator | the answer |
//!
//! An older server committed the charge's record on its own, without waiting for the flush
//! (nothing outside the database followed it before the receipt's flushed commit); merged with
//! the receipt's, it has nothing left to save. A claim that only reads (a replay, a mismatch)
//! writes no WAL and waits for nothing.
//!
//! What proves it: the `--ha` campaign (`proof/run.sh --ha`, in the test command) SIGKILLs the
//! PostgreSQL primary under load and fails (`ok_key_finished`, `client_saw_ride`) if an answered
//! ride or outcome is missing on the promoted standby, which is what a commit that did not wait
//! would lose.

use std::time::Duration;

use schema::schema::idempotency_keys;
use telemetry::settings::ConfigError;

/// The idempotency key presented to the provider for the charge of idempotency key row
/// `key_id`, created under `deployment_id` (the row's `deployment_id` column). Derived from the
/// row, so every attempt at that ride, by any api-server or the completer, presents the same key,
/// and an operator can find the charge (`workers admin`).
///
/// A row without a deployment id was created by a server that predates them: its charge may
/// already have been attempted under the old key, `rocket-rides-{key_id}`, so it keeps exactly
/// that key for good (another key would make the provider charge again). Every newer row has its
/// deployment id, so two environments on one provider account, or a database restored from a
/// backup under another deployment id, never present the same key.
pub fn provider_idempotency_key(deployment_id: Option<&str>, key_id: i64) -> String {
    match deployment_id {
        Some(deployment_id) => format!("rocket-rides-{deployment_id}-{key_id}"),
        None => format!("rocket-rides-{key_id}"),
    }
}

/// The idempotency key presented to the provider for the refund of reconciliation finding
/// `finding_id` by deployment `deployment_id`. Derived from the finding, so every attempt at
/// refunding it (any reconciler pass, a concurrent one, `workers admin findings refund`) presents
/// the same key and the provider makes one refund. A refund tried under the older key
/// (`rocket-rides-refund-{finding_id}`) and retried under this one is still made once: the
/// provider refuses a second full refund, and the refunder then finds the first by its metadata
/// (`workers::reconciler::refund`).
pub fn provider_refund_idempotency_key(deployment_id: &str, finding_id: i64) -> String {
    format!("rocket-rides-refund-{deployment_id}-{finding_id}")
}

/// `IDEMPOTENCY_LOCK_TIMEOUT_SECS`'s default, for every process that judges a lock.
pub const DEFAULT_LOCK_TIMEOUT_SECS: u64 = 90;
/// `IDEMPOTENCY_KEY_TTL_HOURS`'s default: how long a key is kept (and replays) before the reaper
/// retires it; the api-server tells callers when by it, the reaper acts on it.
pub const DEFAULT_KEY_TTL_HOURS: u64 = 72;
/// The shortest `IDEMPOTENCY_KEY_TTL_SECS` taken. A key reaped while its caller may still retry
/// lets that retry charge a second time; five minutes outlasts a retrying client's attempts and
/// the completer's passes, which is all a soak (the one user of seconds) needs.
pub const MIN_KEY_TTL_SECS: u64 = 300;

/// How long a key is kept, read the same way by the api-server (which tells callers) and the
/// reaper (which acts on it): `IDEMPOTENCY_KEY_TTL_SECS` when set (at least
/// [`MIN_KEY_TTL_SECS`]: a soak wants the reaper at work within minutes), else
/// `IDEMPOTENCY_KEY_TTL_HOURS` (default [`DEFAULT_KEY_TTL_HOURS`]).
pub fn key_ttl(vars: &telemetry::settings::Vars<'_>) -> Result<Duration, ConfigError> {
    const NAME: &str = "IDEMPOTENCY_KEY_TTL_SECS";
    match vars.optional::<u64>(NAME)? {
        Some(secs) if secs < MIN_KEY_TTL_SECS => Err(ConfigError::Invalid {
            name: NAME,
            reason: format!(
                "{secs} s is under {MIN_KEY_TTL_SECS} s: a retry after the key is reaped would charge again"
            ),
        }),
        Some(_) => vars.secs(NAME, 0),
        None => vars.hours("IDEMPOTENCY_KEY_TTL_HOURS", DEFAULT_KEY_TTL_HOURS),
    }
}

/// The longest `IDEMPOTENCY_LOCK_TIMEOUT_SECS` taken: a lock held longer than a day is a key
/// stuck for a day, and far beyond any provider call.
pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// `IDEMPOTENCY_LOCK_TIMEOUT_SECS`, read the same way by every process that judges a lock.
pub fn lock_timeout(vars: &telemetry::settings::Vars<'_>) -> Result<Duration, ConfigError> {
    vars.secs_up_to(
        "IDEMPOTENCY_LOCK_TIMEOUT_SECS",
        DEFAULT_LOCK_TIMEOUT_SECS,
        MAX_LOCK_TIMEOUT,
    )
}

/// How a process judges whether a key's lock may be taken over: the arguments of the SQL
/// function `idempotency_lock_state` (migration `2026-11-28-100000_lock_holders`), the one home of
/// the rule, which every process that judges a lock calls (the claim, a waiting duplicate, the
/// completer, the reaper, `workers admin`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockRule {
    /// `IDEMPOTENCY_LOCK_TIMEOUT_SECS`: a lock this old is taken over whoever holds it.
    pub lock_timeout: Duration,
    /// A lock whose holder's session has ended is taken over at once on a key created less than
    /// this long ago ([`provider_key_margin`] of the provider's idempotency window): every charge
    /// attempt at such a key presents the provider the same idempotency key, which the provider
    /// still remembers, so two attempts get one PaymentIntent. An older key may be charged after
    /// a search instead, which is safe only when no other attempt can be charging: it waits for
    /// the lock timeout.
    pub holder_takeover: Duration,
}

impl LockRule {
    /// The rule for a provider that remembers idempotency keys for `provider_window`.
    pub fn new(lock_timeout: Duration, provider_window: Duration) -> LockRule {
        LockRule {
            lock_timeout,
            holder_takeover: provider_key_margin(provider_window),
        }
    }

    /// The function's last two arguments, in seconds.
    pub fn secs(&self) -> (f64, f64) {
        (
            self.lock_timeout.as_secs_f64(),
            self.holder_takeover.as_secs_f64(),
        )
    }
}

/// How long after a ride's creation every charge attempt at it can rely on the provider's
/// idempotency key: the provider's window less a tenth, for clock skew between the database and
/// the provider. Every attempt happened after the ride was created, so a younger ride proves the
/// provider still remembers the key; an older one is looked up before it is charged.
pub fn provider_key_margin(provider_window: Duration) -> Duration {
    provider_window.saturating_sub(provider_window / 10)
}

/// The SQL call of the lock rule on a row of `idempotency_keys` whose columns are in scope
/// unqualified; `$timeout` and `$takeover` are the placeholders (string literals such as `"$4"`)
/// binding [`LockRule::secs`]. A macro so that the statements that use it stay `const` strings.
#[macro_export]
macro_rules! lock_state_sql {
    ($timeout:literal, $takeover:literal) => {
        concat!(
            "idempotency_lock_state(locked_at, lock_holder, created_at, ",
            $timeout,
            ", ",
            $takeover,
            ")"
        )
    };
}

diesel::define_sql_function! {
    /// The lock rule for the diesel DSL: see [`LockRule`].
    fn idempotency_lock_state(
        locked_at: diesel::sql_types::Nullable<diesel::sql_types::Timestamptz>,
        lock_holder: diesel::sql_types::Nullable<diesel::sql_types::BigInt>,
        key_created_at: diesel::sql_types::Timestamptz,
        lock_timeout_secs: diesel::sql_types::Double,
        holder_takeover_secs: diesel::sql_types::Double,
    ) -> diesel::sql_types::Text;
}

/// The lock rule on the row of `idempotency_keys` in scope, for the diesel DSL.
pub fn lock_state_of_key(
    rule: LockRule,
) -> idempotency_lock_state<
    idempotency_keys::locked_at,
    idempotency_keys::lock_holder,
    idempotency_keys::created_at,
    f64,
    f64,
> {
    let (timeout_secs, takeover_secs) = rule.secs();
    idempotency_lock_state(
        idempotency_keys::locked_at,
        idempotency_keys::lock_holder,
        idempotency_keys::created_at,
        timeout_secs,
        takeover_secs,
    )
}

/// What `idempotency_lock_state` says of a key's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockState {
    /// Not locked.
    Free,
    /// Locked for at least the lock timeout: taken over whoever holds it.
    Expired,
    /// Locked by a holder whose liveness session has ended, on a key young enough to be taken
    /// over at once.
    HolderGone,
    /// Held: leave it to its holder.
    Live,
}

impl LockState {
    /// The function's answer; anything it does not say is taken as `Live` (leave the key alone).
    pub fn parse(state: &str) -> LockState {
        match state {
            "free" => LockState::Free,
            "expired" => LockState::Expired,
            "holder_gone" => LockState::HolderGone,
            _ => LockState::Live,
        }
    }

    pub fn is_live(self) -> bool {
        self == LockState::Live
    }

    /// Why a lock in this state is taken over (the `reason` of the takeover metric); `None` for
    /// a key that was not locked, or is held.
    pub fn takeover_reason(self) -> Option<&'static str> {
        match self {
            LockState::Expired => Some("lock_expired"),
            LockState::HolderGone => Some("holder_gone"),
            LockState::Free | LockState::Live => None,
        }
    }
}

/// A configured duration (the lock timeout, the key TTL) as timestamp arithmetic wants it; one
/// too long for chrono saturates rather than fails.
pub fn chrono_duration(duration: Duration) -> chrono::Duration {
    chrono::Duration::from_std(duration).unwrap_or(chrono::Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_deployment_id_makes_a_charge_key_equal_to_a_refund_key() {
        // The charge keys of existing rows never change.
        assert_eq!(
            provider_idempotency_key(Some("prod"), 7),
            "rocket-rides-prod-7"
        );
        assert_eq!(provider_idempotency_key(None, 7), "rocket-rides-7");
        // `refund-prod`'s charge of key 7 would be `prod`'s refund of finding 7, and `refund`'s
        // the older refund key: such ids are refused.
        for colliding in ["refund-prod", "refund"] {
            assert!(
                provider::DeploymentId::parse(colliding).is_err(),
                "{colliding}"
            );
        }
        let refund_keys = [
            provider_refund_idempotency_key("prod", 7),
            "rocket-rides-refund-7".to_owned(),
        ];
        for id in [
            "prod",
            "refunds",
            "re-fund",
            "r",
            "dev",
            "0-refund",
            "prod-refund-7",
        ] {
            let id = provider::DeploymentId::parse(id).unwrap();
            let charge = provider_idempotency_key(Some(id.as_str()), 7);
            assert!(!charge.starts_with("rocket-rides-refund-"), "{charge}");
            assert!(!refund_keys.contains(&charge), "{charge}");
        }
    }

    #[test]
    fn a_key_without_a_deployment_id_keeps_the_old_provider_key() {
        assert_eq!(provider_idempotency_key(None, 42), "rocket-rides-42");
        assert_eq!(
            provider_idempotency_key(Some("prod-eu"), 42),
            "rocket-rides-prod-eu-42"
        );
        assert_ne!(
            provider_idempotency_key(Some("staging"), 42),
            provider_idempotency_key(Some("prod"), 42)
        );
        assert_eq!(
            provider_refund_idempotency_key("prod", 7),
            "rocket-rides-refund-prod-7"
        );
    }

    #[test]
    fn a_holder_is_taken_over_at_once_only_inside_the_provider_key_margin() {
        let rule = LockRule::new(Duration::from_secs(90), Duration::from_secs(86_400));
        assert_eq!(rule.holder_takeover, Duration::from_secs(77_760));
        assert_eq!(rule.secs(), (90.0, 77_760.0));
        assert_eq!(
            LockState::parse("holder_gone").takeover_reason(),
            Some("holder_gone")
        );
        assert_eq!(
            LockState::parse("expired").takeover_reason(),
            Some("lock_expired")
        );
        assert!(LockState::parse("live").is_live());
        assert!(LockState::parse("something new").is_live());
        assert!(!LockState::parse("free").is_live());
    }

    #[test]
    fn the_key_ttl_is_seconds_when_set_and_never_under_the_floor() {
        let read = |pairs: &[(&str, &str)]| {
            let map: std::collections::HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            let lookup = |name: &str| map.get(name).cloned();
            key_ttl(&telemetry::settings::Vars::new(&lookup)).map_err(|e| e.to_string())
        };
        assert_eq!(read(&[]), Ok(Duration::from_secs(72 * 3600)));
        assert_eq!(
            read(&[("IDEMPOTENCY_KEY_TTL_HOURS", "2")]),
            Ok(Duration::from_secs(7200))
        );
        assert_eq!(
            read(&[
                ("IDEMPOTENCY_KEY_TTL_HOURS", "2"),
                ("IDEMPOTENCY_KEY_TTL_SECS", "600")
            ]),
            Ok(Duration::from_secs(600))
        );
        let refused = read(&[("IDEMPOTENCY_KEY_TTL_SECS", "299")]).unwrap_err();
        assert!(refused.contains("IDEMPOTENCY_KEY_TTL_SECS"), "{refused}");
        assert!(read(&[("IDEMPOTENCY_KEY_TTL_SECS", "soon")]).is_err());
    }
}
