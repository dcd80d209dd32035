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

    /// Whole seconds.
    pub fn secs(&self, name: &'static str, default: u64) -> Result<Duration, ConfigError> {
        Ok(Duration::from_secs(self.parse(name, default)?))
    }

    /// Milliseconds.
    pub fn millis(&self, name: &'static str, default: u64) -> Result<Duration, ConfigError> {
        Ok(Duration::from_millis(self.parse(name, default)?))
    }

    /// Whole hours, more than zero.
    pub fn hours(&self, name: &'static str, default: u32) -> Result<Duration, ConfigError> {
        Ok(Duration::from_secs(
            u64::from(self.positive::<u32>(name, default)?) * 3600,
        ))
    }
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
            assert_eq!(vars.hours("TWO", 72).unwrap(), Duration::from_secs(7200));
            assert_eq!(
                vars.hours("UNSET", 72).unwrap(),
                Duration::from_secs(72 * 3600)
            );
        });
    }
}
