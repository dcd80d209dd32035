//! Unlocking, in the background, a key that an attempt may hold when the database was unreachable
//! at the moment it should have let go (a failover). Without it the key stays locked until the
//! lock timeout (90 s by default) and every retry in between is refused `IDEMPOTENCY_KEY_IN_USE`.
//!
//! Two cases, one per [`Unlock`] variant:
//!
//! - a phase failed and so did the unlock of its lease ([`crate::rides`]);
//! - the claim itself failed, but its statement may have committed before the connection was lost
//!   (a commit whose acknowledgement died with the primary but that the synchronous standby,
//!   now the primary, holds): the key is then locked by this attempt's claim token, which only
//!   this attempt knows.
//!
//! Every unlock is fenced by the token, so it is safe at any time: once another attempt has taken
//! the key over, or when the claim never committed, it changes nothing. Its outcome is only
//! logged; nobody waits for it.

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use contract::writes::KeyFence;
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::RunQueryDsl;
use schema::{
    Pool,
    schema::{idempotency_keys, users},
    store::{ConflictRetry, StoreError, retry_transient},
};
use uuid::Uuid;

use super::{IdempotencyKey, Lease, phase::release_key, release};
use crate::auth::Caller;

/// What to unlock.
#[derive(Clone, Debug)]
pub enum Unlock {
    /// The lease of an attempt whose phase failed.
    Lease(Lease),
    /// The key `key` of `caller`, if a claim that failed locked it with `token` after all.
    Claim {
        caller: Caller,
        key: IdempotencyKey,
        token: Uuid,
    },
}

/// The first pause before an unlock is tried again, doubled after each failure up to
/// [`RETRY_MAX_DELAY`]: a failover's new primary is usually up within a few seconds.
const RETRY_FIRST_DELAY: Duration = Duration::from_millis(100);
const RETRY_MAX_DELAY: Duration = Duration::from_secs(2);

/// Background unlocks at once, at most: in a long outage every failed attempt wants one, and a
/// lock left alone still expires by itself.
const MAX_IN_FLIGHT: usize = 1024;
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

impl Unlock {
    /// One try: whether the key was unlocked (false: nothing of this attempt's was locked).
    pub async fn once(&self, pool: &Pool, policy: ConflictRetry) -> Result<bool, StoreError> {
        match self {
            Unlock::Lease(lease) => release(pool, policy, lease).await,
            Unlock::Claim { caller, key, token } => {
                release_claim(pool, policy, *caller, key, *token).await
            }
        }
    }

    /// Tries again and again in a task of its own, with back-off, until an unlock succeeds or
    /// `expires` (no later than the lock's own expiry) has passed. False when [`MAX_IN_FLIGHT`]
    /// are already running: the lock is then left to expire.
    pub fn retry_in_background(self, pool: Pool, policy: ConflictRetry, expires: Instant) -> bool {
        if IN_FLIGHT.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
            IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(
                "too many keys being unlocked in the background; this lock expires by itself"
            );
            return false;
        }
        tokio::spawn(async move {
            self.retry_until(&pool, policy, expires).await;
            IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
        });
        true
    }

    async fn retry_until(&self, pool: &Pool, policy: ConflictRetry, expires: Instant) {
        let mut delay = RETRY_FIRST_DELAY;
        let mut failures = 0_u32;
        loop {
            let pause = delay.min(expires.saturating_duration_since(Instant::now()));
            if pause.is_zero() {
                tracing::warn!(
                    unlock = self.label(),
                    failures,
                    "gave up unlocking a key; its lock expires by itself"
                );
                return;
            }
            tokio::time::sleep(pause).await;
            match self.once(pool, policy).await {
                Ok(unlocked) => {
                    tracing::info!(
                        unlock = self.label(),
                        failures,
                        unlocked,
                        "key unlock retried"
                    );
                    return;
                }
                Err(error) => {
                    failures += 1;
                    tracing::debug!(%error, unlock = self.label(), failures, "key unlock failed again");
                    delay = delay.saturating_mul(2).min(RETRY_MAX_DELAY);
                }
            }
        }
    }

    /// What is unlocked, for the metric's `kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            Unlock::Lease(_) => "lease",
            Unlock::Claim { .. } => "claim",
        }
    }

    /// For the logs: the key id of a lease; a failed claim's key is a caller's and not logged.
    fn label(&self) -> String {
        match self {
            Unlock::Lease(lease) => format!("key_id {}", lease.key_id),
            Unlock::Claim { .. } => "a failed claim's key".to_owned(),
        }
    }
}

/// Unlocks `caller`'s key `key` if it is locked by `token`: found through the `(user_id,
/// idempotency_key)` unique index (a token's user is looked up by its digest), then released
/// with the statement every unlock runs.
async fn release_claim(
    pool: &Pool,
    policy: ConflictRetry,
    caller: Caller,
    key: &IdempotencyKey,
    token: Uuid,
) -> Result<bool, StoreError> {
    let found: Option<(i64, i64)> = retry_transient(policy, || async {
        let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
        let locked_by_token = idempotency_keys::table
            .filter(idempotency_keys::idempotency_key.eq(key.as_str()))
            .filter(idempotency_keys::lock_token.eq(token))
            .select((idempotency_keys::id, idempotency_keys::user_id))
            .into_boxed();
        let of_caller = match caller {
            Caller::OnBehalfOf(user_id) => {
                locked_by_token.filter(idempotency_keys::user_id.eq(user_id))
            }
            Caller::Token(digest) => {
                let user = users::table
                    .filter(users::api_token_digest.eq(digest.to_vec()))
                    .select(users::id);
                locked_by_token.filter(idempotency_keys::user_id.eq_any(user))
            }
        };
        Ok(of_caller.first(&mut conn).await.optional()?)
    })
    .await?;
    let Some((key_id, user_id)) = found else {
        return Ok(false);
    };
    let fence = KeyFence {
        key_id,
        user_id,
        token,
    };
    release_key(pool, policy, fence).await
}
