//! The validated idempotency key a client sends in `idempotency-key` metadata.

use std::fmt;

pub const MIN_LEN: usize = 20;
pub const MAX_LEN: usize = 255;

/// 20 to 255 visible ASCII characters. Once constructed, a key is known to fit the column and to
/// be safe to echo in an error.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidKey {
    #[error("the idempotency key is shorter than {MIN_LEN} characters")]
    TooShort,
    #[error("the idempotency key is longer than {MAX_LEN} characters")]
    TooLong,
    #[error("the idempotency key may contain only visible ASCII characters")]
    InvalidCharacter,
}

impl IdempotencyKey {
    pub fn parse(raw: &str) -> Result<IdempotencyKey, InvalidKey> {
        if !raw.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidKey::InvalidCharacter);
        }
        match raw.len() {
            len if len < MIN_LEN => Err(InvalidKey::TooShort),
            len if len > MAX_LEN => Err(InvalidKey::TooLong),
            _ => Ok(IdempotencyKey(raw.to_owned())),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A prefix that is enough to find the key in the database, for logs: a full key is a
    /// credential-like value (whoever holds it can replay the outcome as that user).
    pub fn redacted(&self) -> String {
        format!("{}…", &self.0[..6])
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({})", self.redacted())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_range() {
        assert!(IdempotencyKey::parse(&"a".repeat(MIN_LEN)).is_ok());
        assert!(IdempotencyKey::parse(&"~".repeat(MAX_LEN)).is_ok());
        assert_eq!(
            IdempotencyKey::parse(&"a".repeat(MIN_LEN - 1)),
            Err(InvalidKey::TooShort)
        );
        assert_eq!(
            IdempotencyKey::parse(&"a".repeat(MAX_LEN + 1)),
            Err(InvalidKey::TooLong)
        );
        assert_eq!(IdempotencyKey::parse(""), Err(InvalidKey::TooShort));
    }

    #[test]
    fn rejects_invisible_and_non_ascii_characters() {
        for raw in [
            "aaaaaaaaaa aaaaaaaaaa",
            "aaaaaaaaaa\taaaaaaaaaa",
            "aaaaaaaaaaéaaaaaaaaaa",
            "aaaaaaaaaa\u{7f}aaaaaaaaaa",
        ] {
            assert_eq!(
                IdempotencyKey::parse(raw),
                Err(InvalidKey::InvalidCharacter)
            );
        }
    }

    #[test]
    fn debug_output_hides_the_key() {
        let key = IdempotencyKey::parse("secret-key-0123456789-abcdef").unwrap();
        let printed = format!("{key:?}");
        assert!(!printed.contains("0123456789"));
        assert!(printed.contains("secret"));
    }
}
