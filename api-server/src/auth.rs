//! API tokens. A token is shown once, when its user is created; the database keeps only its
//! SHA-256 digest, so a leaked database does not leak credentials. Tokens have 256 bits of
//! entropy, which is why an unsalted fast hash is enough here (unlike passwords).

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use rand::RngCore;
use schema::{
    Pool,
    models::{NewUser, User},
    schema::users,
};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use schema::store::StoreError;

/// Who is calling, as far as the credentials say before any database lookup: a user's token (by
/// its digest, one token per user) or the internal credential acting for a user id. The limits
/// are kept per caller, and the claim authenticates it in its own statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Caller {
    Token([u8; 32]),
    OnBehalfOf(i64),
}

impl Caller {
    /// Whether a claim by this caller may insert a key: a user's own token may; a call on a
    /// user's behalf (the completer's) only finishes keys that exist.
    pub fn may_insert_keys(self) -> bool {
        match self {
            Caller::Token(_) => true,
            Caller::OnBehalfOf(_) => false,
        }
    }
}

const TOKEN_PREFIX: &str = "rr_";
/// 32 random bytes in unpadded base64url.
const TOKEN_BODY_LEN: usize = 43;

/// A freshly generated token: its only copy outside the caller's hands is its digest.
pub fn generate_token() -> String {
    let mut bytes = [0_u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{TOKEN_PREFIX}{}", URL_SAFE_NO_PAD.encode(bytes))
}

/// Whether `token` has the shape of a token [`generate_token`] makes: anything else is refused
/// without a database lookup.
pub fn is_token_shaped(token: &str) -> bool {
    token.strip_prefix(TOKEN_PREFIX).is_some_and(|body| {
        body.len() == TOKEN_BODY_LEN
            && body
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

pub fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The token in an `authorization: Bearer <token>` value, if the value has that form.
pub fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The user whose token has this digest. The lookup is by digest through a unique index, so its
/// timing says nothing about how close a guess came.
pub async fn user_by_token_digest(
    pool: &Pool,
    digest: &[u8; 32],
) -> Result<Option<User>, StoreError> {
    let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
    Ok(users::table
        .filter(users::api_token_digest.eq(digest.as_slice()))
        .select(User::as_select())
        .first(&mut conn)
        .await
        .optional()?)
}

/// Whether `presented` is the internal credential. Compares digests in constant time, so neither
/// the length nor any prefix of the real token leaks through timing.
pub fn is_internal_token(presented: &str, internal: &str) -> bool {
    token_digest(presented)
        .ct_eq(&token_digest(internal))
        .into()
}

/// A user by id, for calls made on a user's behalf by the completer.
pub async fn user_by_id(pool: &Pool, user_id: i64) -> Result<Option<User>, StoreError> {
    let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
    Ok(users::table
        .find(user_id)
        .select(User::as_select())
        .first(&mut conn)
        .await
        .optional()?)
}

#[derive(Debug, thiserror::Error)]
pub enum CreateUserError {
    #[error("{0}")]
    Invalid(&'static str),
    #[error("a user with this email or Stripe customer already exists")]
    Exists,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Creates a user and returns it with its new token.
pub async fn create_user(
    pool: &Pool,
    email: &str,
    stripe_customer_id: &str,
    stripe_payment_method_id: &str,
) -> Result<(User, String), CreateUserError> {
    // One bare address: no display name, no list, no CR/LF (receipts put it in a header).
    if email.len() > 255 || email.parse::<lettre::Address>().is_err() {
        return Err(CreateUserError::Invalid(
            "email must be one plain address such as rider@example.com (no display name, no list)",
        ));
    }
    for (value, what) in [
        (
            stripe_customer_id,
            "stripe customer id must be 1 to 255 characters",
        ),
        (
            stripe_payment_method_id,
            "stripe payment method id must be 1 to 255 characters",
        ),
    ] {
        if value.is_empty() || value.len() > 255 {
            return Err(CreateUserError::Invalid(what));
        }
    }
    let token = generate_token();
    let digest = token_digest(&token);
    let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
    let user = diesel::insert_into(users::table)
        .values(NewUser {
            email,
            stripe_customer_id,
            stripe_payment_method_id,
            api_token_digest: &digest,
        })
        .returning(User::as_returning())
        .get_result(&mut conn)
        .await
        .map_err(|error| match error {
            diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::UniqueViolation,
                _,
            ) => CreateUserError::Exists,
            error => CreateUserError::Store(error.into()),
        })?;
    Ok((user, token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bearer_values() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer   abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("abc"), None);
    }

    #[test]
    fn recognises_only_the_exact_internal_token() {
        let internal = "internal-token-0123456789-0123456789";
        assert!(is_internal_token(internal, internal));
        assert!(!is_internal_token(
            "internal-token-0123456789-012345678",
            internal
        ));
        assert!(!is_internal_token("", internal));
    }

    #[tokio::test]
    async fn create_user_takes_one_plain_address_only() {
        // Refused before any connection is needed: this pool has no database behind it.
        let pool = schema::build_pool(
            "postgres://postgres@127.0.0.1:1/none",
            1,
            std::time::Duration::from_millis(100),
            schema::PlanCache::Auto,
        );
        for email in [
            "a@b.c\r\nBcc: x@y.z",
            "Name <a@b.c>",
            "a@b.c, d@e.f",
            "a@b.c\n",
            "no-at-sign",
        ] {
            match create_user(&pool, email, "cus_1", "pm_1").await {
                Err(CreateUserError::Invalid(message)) => {
                    assert!(message.contains("one plain address"), "{message}");
                }
                other => panic!("{email:?} was not refused as invalid: {other:?}"),
            }
        }
    }

    #[test]
    fn only_generated_tokens_are_token_shaped() {
        assert!(is_token_shaped(&generate_token()));
        let body = "A".repeat(TOKEN_BODY_LEN);
        assert!(is_token_shaped(&format!("rr_{body}")));
        assert!(!is_token_shaped(&format!("rr_{body}A")));
        assert!(!is_token_shaped(&format!("xx_{body}")));
        assert!(!is_token_shaped(&format!("rr_{}=", &body[1..])));
        assert!(!is_token_shaped("internal-test-token-0123456789abcdef"));
        assert!(!is_token_shaped(""));
    }

    #[test]
    fn tokens_are_unique_and_digests_fixed_size() {
        let (a, b) = (generate_token(), generate_token());
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX));
        assert_eq!(token_digest(&a).len(), 32);
        assert_ne!(token_digest(&a), token_digest(&b));
    }
}
