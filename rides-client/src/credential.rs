//! Who a call is made as. A user calls with their own API token; the completer calls with the
//! internal credential on behalf of the key's user. Tokens are [`Secret`]s: their `Debug` is
//! redacted and they reach nothing but the `authorization` metadata (marked sensitive there, so
//! HTTP/2 tracing never prints it either).

use telemetry::Secret;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};

/// The caller's credential.
#[derive(Clone, Debug)]
pub enum Credential {
    /// A user's API token (`rr_…`), sent as `authorization: Bearer <token>`.
    User(Secret),
    /// The internal credential (`INTERNAL_API_TOKEN`), with `on-behalf-of-user: <user id>`.
    /// The server accepts it for CreateRide only (`INTERNAL_CREDENTIAL_NOT_ALLOWED` otherwise).
    Internal { token: Secret, on_behalf_of: i64 },
}

impl Credential {
    pub fn user(token: impl Into<String>) -> Credential {
        Credential::User(Secret::new(token))
    }

    pub fn internal(token: impl Into<String>, on_behalf_of: i64) -> Credential {
        Credential::Internal {
            token: Secret::new(token),
            on_behalf_of,
        }
    }

    /// Writes the credential's metadata. `Err` when the token cannot be a header value (not
    /// visible ASCII): nothing is sent then.
    pub(crate) fn apply(&self, metadata: &mut MetadataMap) -> Result<(), InvalidToken> {
        let (token, on_behalf_of) = match self {
            Credential::User(token) => (token, None),
            Credential::Internal {
                token,
                on_behalf_of,
            } => (token, Some(*on_behalf_of)),
        };
        let mut authorization = AsciiMetadataValue::try_from(format!("Bearer {}", token.expose()))
            .map_err(|_| InvalidToken)?;
        authorization.set_sensitive(true);
        metadata.insert(proto::metadata::AUTHORIZATION, authorization);
        if let Some(user) = on_behalf_of {
            metadata.insert(
                proto::metadata::ON_BEHALF_OF_USER,
                AsciiMetadataValue::from(user),
            );
        }
        Ok(())
    }
}

/// The token has characters a header cannot carry.
#[derive(Debug)]
pub(crate) struct InvalidToken;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn debug_never_shows_the_token() {
        let user = Credential::user("rr_supersecret");
        let internal = Credential::internal("internal-supersecret", 7);
        for credential in [&user, &internal] {
            let shown = format!("{credential:?}");
            assert!(!shown.contains("supersecret"), "{shown}");
        }
        assert!(format!("{internal:?}").contains("on_behalf_of: 7"));
    }

    #[test]
    fn writes_the_metadata() {
        let mut metadata = MetadataMap::new();
        Credential::internal("tok", 42)
            .apply(&mut metadata)
            .unwrap();
        assert_eq!(metadata.get("authorization").unwrap(), "Bearer tok");
        assert!(metadata.get("authorization").unwrap().is_sensitive());
        assert_eq!(metadata.get("on-behalf-of-user").unwrap(), "42");
        let mut metadata = MetadataMap::new();
        Credential::user("tok").apply(&mut metadata).unwrap();
        assert!(metadata.get("on-behalf-of-user").is_none());
        assert!(Credential::user("bad\ntoken").apply(&mut metadata).is_err());
    }
}
