//! Reading settings from the environment: the one helper every process's typed configuration
//! (`api_server::config`, `workers::config`) reads its variables through, so that an empty
//! variable, a default, a unit and a refusal mean the same thing in every process.
//!
//! An unset or empty variable takes its default; a set one must parse, or start-up stops with
//! [`ConfigError::Invalid`] naming it.

use std::{fmt, path::PathBuf, str::FromStr, time::Duration};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{name} is not valid: {reason}")]
    Invalid { name: &'static str, reason: String },
    #[error("{name} is required")]
    Missing { name: &'static str },
}

/// The longest duration any setting may take. Durations are added to an `Instant` or a
/// timestamp at run time, where one this large would overflow and panic; no setting needs a year.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The variables, through a lookup (the process environment, or a map in tests).
pub struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl<'a> Vars<'a> {
    pub fn new(lookup: &'a dyn Fn(&str) -> Option<String>) -> Vars<'a> {
        Vars(lookup)
    }

    /// The raw value; `None` when unset or empty.
    pub fn raw(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|value| !value.is_empty())
    }

    pub fn string(&self, name: &str, default: &str) -> String {
        self.raw(name).unwrap_or_else(|| default.to_owned())
    }

    pub fn parse<T>(&self, name: &'static str, default: T) -> Result<T, ConfigError>
    where
        T: FromStr,
        T::Err: fmt::Display,
    {
        Ok(self.optional(name)?.unwrap_or(default))
    }

    /// A variable with no fixed default: `None` when unset or empty.
    pub fn optional<T>(&self, name: &'static str) -> Result<Option<T>, ConfigError>
    where
        T: FromStr,
        T::Err: fmt::Display,
    {
        self.raw(name)
            .map(|raw| {
                raw.trim()
                    .parse()
                    .map_err(|error: T::Err| ConfigError::Invalid {
                        name,
                        reason: error.to_string(),
                    })
            })
            .transpose()
    }

    /// A count or size that zero would make meaningless: zero is refused, not rounded up.
    pub fn positive<T>(&self, name: &'static str, default: T) -> Result<T, ConfigError>
    where
        T: FromStr + PartialOrd + Default,
        T::Err: fmt::Display,
    {
        let value = self.parse(name, default)?;
        if value <= T::default() {
            return Err(ConfigError::Invalid {
                name,
                reason: "must be greater than zero".into(),
            });
        }
        Ok(value)
    }

    pub fn path(&self, name: &str) -> Option<PathBuf> {
        self.raw(name).map(PathBuf::from)
    }

    /// Whole seconds, at most [`MAX_DURATION`].
    pub fn secs(&self, name: &'static str, default: u64) -> Result<Duration, ConfigError> {
        self.duration(name, default, 1000, MAX_DURATION)
    }

    /// Whole seconds, at most `max` (a tighter bound than [`MAX_DURATION`]).
    pub fn secs_up_to(
        &self,
        name: &'static str,
        default: u64,
        max: Duration,
    ) -> Result<Duration, ConfigError> {
        self.duration(name, default, 1000, max.min(MAX_DURATION))
    }

    /// Milliseconds, at most [`MAX_DURATION`].
    pub fn millis(&self, name: &'static str, default: u64) -> Result<Duration, ConfigError> {
        self.duration(name, default, 1, MAX_DURATION)
    }

    /// Milliseconds, more than zero and at most [`MAX_DURATION`].
    pub fn positive_millis(
        &self,
        name: &'static str,
        default: u64,
    ) -> Result<Duration, ConfigError> {
        self.positive::<u64>(name, default)?;
        self.millis(name, default)
    }

    /// Whole seconds, more than zero and at most [`MAX_DURATION`].
    pub fn positive_secs(&self, name: &'static str, default: u64) -> Result<Duration, ConfigError> {
        self.positive::<u64>(name, default)?;
        self.secs(name, default)
    }

    /// Whole hours, more than zero and at most [`MAX_DURATION`].
    pub fn hours(&self, name: &'static str, default: u64) -> Result<Duration, ConfigError> {
        self.positive::<u64>(name, default)?;
        self.duration(name, default, 3_600_000, MAX_DURATION)
    }

    /// `count` units of `unit_millis` milliseconds, at most `max`.
    fn duration(
        &self,
        name: &'static str,
        default: u64,
        unit_millis: u64,
        max: Duration,
    ) -> Result<Duration, ConfigError> {
        let count: u64 = self.parse(name, default)?;
        count
            .checked_mul(unit_millis)
            .map(Duration::from_millis)
            .filter(|duration| *duration <= max)
            .ok_or_else(|| ConfigError::Invalid {
                name,
                reason: format!("must be at most {} s", max.as_secs()),
            })
    }
}

/// Words that mark an example value (`FAKE-…-change-me`): refused as a credential outside
/// development, whatever its length.
const PLACEHOLDER_MARKERS: [&str; 10] = [
    "fake",
    "change-me",
    "changeme",
    "change_me",
    "example",
    "placeholder",
    "replace",
    "dummy",
    "insecure",
    "xxxxxxxx",
];

/// The least entropy a credential must show, as estimated from its characters' frequencies
/// (bits): 32 random hex characters show about 120, 32 random base64url ones about 150.
const MIN_SECRET_BITS: f64 = 96.0;

/// Refuses a credential that is an example value or plainly not random: it contains a
/// placeholder word, repeats a shorter pattern, or shows under [`MIN_SECRET_BITS`] of entropy.
/// For the settings that guard production; development runs keep their fixed test tokens.
pub fn refuse_weak_secret(name: &'static str, value: &str) -> Result<(), ConfigError> {
    refuse_placeholder(name, value)?;
    let invalid = |reason: &str| ConfigError::Invalid {
        name,
        reason: format!("{reason}: generate one, e.g. `openssl rand -base64 32`"),
    };
    let bytes = value.as_bytes();
    let periodic = (1..=bytes.len() / 2).any(|period| {
        bytes.len().is_multiple_of(period) && bytes.chunks(period).all(|c| c == &bytes[..period])
    });
    if periodic {
        return Err(invalid("is a repeated pattern, not a random value"));
    }
    if estimated_bits(bytes) < MIN_SECRET_BITS {
        return Err(invalid("has too little entropy to be a random value"));
    }
    Ok(())
}

/// Refuses a value that contains a placeholder word (`fake`, `change-me`, `example`, …).
pub fn refuse_placeholder(name: &'static str, value: &str) -> Result<(), ConfigError> {
    let lower = value.to_ascii_lowercase();
    match PLACEHOLDER_MARKERS
        .iter()
        .find(|marker| lower.contains(*marker))
    {
        Some(marker) => Err(ConfigError::Invalid {
            name,
            reason: format!("holds the placeholder {marker:?}: an example value, not a credential"),
        }),
        None => Ok(()),
    }
}

/// Shannon entropy of the byte frequencies, times the length.
fn estimated_bits(bytes: &[u8]) -> f64 {
    let mut counts = [0_u32; 256];
    for byte in bytes {
        counts[usize::from(*byte)] += 1;
    }
    let len = bytes.len() as f64;
    let per_byte: f64 = counts
        .iter()
        .filter(|count| **count > 0)
        .map(|count| {
            let p = f64::from(*count) / len;
            -p * p.log2()
        })
        .sum();
    per_byte * len
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn with<R>(pairs: &[(&str, &str)], read: impl FnOnce(&Vars<'_>) -> R) -> R {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let lookup = |name: &str| map.get(name).cloned();
        read(&Vars::new(&lookup))
    }

    #[test]
    fn unset_and_empty_take_the_default_and_a_set_value_must_parse() {
        with(&[("EMPTY", ""), ("SET", " 7 "), ("BAD", "seven")], |vars| {
            assert_eq!(vars.parse("UNSET", 3_u32).unwrap(), 3);
            assert_eq!(vars.parse("EMPTY", 3_u32).unwrap(), 3);
            assert_eq!(vars.parse("SET", 3_u32).unwrap(), 7);
            assert!(matches!(
                vars.parse("BAD", 3_u32),
                Err(ConfigError::Invalid { name: "BAD", .. })
            ));
            assert_eq!(vars.string("EMPTY", "d"), "d");
        });
    }

    #[test]
    fn zero_is_refused_where_a_positive_value_is_needed() {
        with(&[("ZERO", "0"), ("TWO", "2")], |vars| {
            assert!(vars.positive("ZERO", 5_u32).is_err());
            assert!(vars.hours("ZERO", 72).is_err());
            assert!(vars.positive_secs("ZERO", 72).is_err());
            assert_eq!(vars.hours("TWO", 72).unwrap(), Duration::from_secs(7200));
            assert_eq!(
                vars.hours("UNSET", 72).unwrap(),
                Duration::from_secs(72 * 3600)
            );
        });
    }

    #[test]
    fn a_huge_duration_is_refused_at_start_up() {
        let huge = u64::MAX.to_string();
        let year_and_a_day = (366 * 24 * 3600).to_string();
        with(
            &[
                ("HUGE", &huge),
                ("LONG", &year_and_a_day),
                ("HOURS", "9000"),
            ],
            |vars| {
                for name in ["HUGE", "LONG"] {
                    assert!(vars.secs(name, 1).is_err(), "{name}");
                    assert!(vars.millis(name, 1).is_ok() || name == "HUGE");
                }
                assert!(vars.millis("HUGE", 1).is_err());
                assert!(vars.hours("HUGE", 1).is_err());
                assert!(vars.hours("HOURS", 1).is_err());
                assert!(vars.secs_up_to("LONG", 1, Duration::from_secs(60)).is_err());
                assert_eq!(vars.secs("UNSET", 60).unwrap(), Duration::from_secs(60));
                assert_eq!(vars.secs("LONG", 1).ok(), None);
            },
        );
    }

    #[test]
    fn placeholders_and_low_entropy_credentials_are_refused() {
        for weak in [
            "FAKE-internal-token-0000000000000000000000000000-change-me",
            "please-replace-this-with-a-real-internal-token",
            "00000000000000000000000000000000",
            "0123456789abcdef0123456789abcdef",
            "aaaaaaaaaaaaaaaabbbbbbbbbbbbbbbbcccccccc",
            "passwordpasswordpasswordpassword1",
        ] {
            assert!(refuse_weak_secret("TOKEN", weak).is_err(), "{weak}");
        }
        for random in [
            "3q2+7wVyd0x8bP1sQ9fZkT4nHcM6aR5eLuJoYgWiXvA=",
            "9f86d081884c7d659a2feaa0c55ad015",
            "rr_dGhpcyBpcyBub3QgYSByZWFsIHRva2VuIGF0IGFsbA",
        ] {
            assert!(refuse_weak_secret("TOKEN", random).is_ok(), "{random}");
        }
    }
}
