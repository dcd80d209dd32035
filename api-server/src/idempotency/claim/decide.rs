//! Deciding a claim from what its statement found: at once for a new key, a replay, a mismatch
//! or another attempt's live lock, under the key row's lock for a key that may need work.

use std::sync::Arc;

use contract::{
    StoredResponse,
    key::{LockState, lock_state_of_key},
};
use diesel::{BoolExpressionMethods, ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{
    JsonText, RecoveryPoint,
    models::User,
    schema::idempotency_keys,
    store::{StoreError, retry_transient},
};
use uuid::Uuid;

use super::{
    ClaimRequest, ClaimRow, ClaimStatement, Claimed, Claims, Decision, FoundKey, count_statement,
};
use crate::idempotency::{Batcher, Lease};

/// How many insert/inspect rounds a claim makes before giving up on a key that keeps vanishing.
const CLAIM_ROUNDS: usize = 5;

/// One claim, for the steps after its first statement.
pub(super) struct ClaimContext<'a, S: ClaimStatement> {
    pub claims: &'a Arc<Batcher<Claims<S>>>,
    /// The lock of every statement of this claim: one that finds the key locked by its token
    /// finds its own earlier statement's lock, committed though its answer was lost.
    pub claim: ClaimRequest<S::FirstPhase>,
}

/// What a claim's statement found: the key it inserted (so this attempt owns it), or the key
/// that was already there with its lock's state, to be decided.
pub(super) enum KeyFound<W> {
    Inserted(Box<Claimed<W>>),
    Existing(Box<FoundKey>, LockState),
}

impl<S: ClaimStatement> ClaimContext<'_, S> {
    /// The claim's statement; `None` if there is no such user, or if a concurrent claim
    /// inserted the key meanwhile.
    pub async fn insert_or_read(&self) -> Result<Option<(User, KeyFound<S::Written>)>, StoreError> {
        count_statement("insert_or_read");
        let row = self.claims.run(self.claim.clone()).await?;
        Ok(row.map(|row| self.found(row)))
    }

    /// Claims the key again until a round decides it.
    pub async fn rounds(&self, user_id: i64) -> Result<Claimed<S::Written>, StoreError> {
        // Each round pays only for what the key needs: a new key, a replay, a mismatch and a key
        // in use are one statement; only a key that may need work takes the row lock. A round ends without a
        // decision only if another claim inserted the key after this one's snapshot, or the key
        // was reaped between two steps, so a few rounds suffice.
        for _ in 0..CLAIM_ROUNDS {
            let Some((_, found)) = self.insert_or_read().await? else {
                continue;
            };
            if let Some(claimed) = self.decide(user_id, found).await? {
                return Ok(claimed);
            }
        }
        Err(StoreError::KeyVanished)
    }

    /// What a claim's statement found, decided: at once for a new key, a replay, a mismatch or
    /// a key in use, under the row lock otherwise. `None` if the key was reaped meanwhile.
    pub async fn decide(
        &self,
        user_id: i64,
        found: KeyFound<S::Written>,
    ) -> Result<Option<Claimed<S::Written>>, StoreError> {
        match self.decide_by_read(found)? {
            Some(claimed) => Ok(Some(claimed)),
            None => self.lock(user_id).await,
        }
    }

    /// The decisions a read makes. A finished key never changes again, and neither do the
    /// parameters a key is bound to, so a replay or a mismatch can be decided from a plain read:
    /// no row lock, no transaction id, no WAL flush. Nor is a refusal a write: another attempt's
    /// lock that was live when the statement read it answers `InUse` (the same answer the caller
    /// would have had a moment earlier; nothing is taken over, nothing moves). A key inserted by
    /// this claim is its own. `None` for a key that may need work (free, this claim's own, or a
    /// lock the rule lets it take over), which only [`Self::lock`] decides.
    pub fn decide_by_read(
        &self,
        found: KeyFound<S::Written>,
    ) -> Result<Option<Claimed<S::Written>>, StoreError> {
        let (mut row, lock_state) = match found {
            KeyFound::Inserted(claimed) => return Ok(Some(*claimed)),
            KeyFound::Existing(row, lock_state) => (row, lock_state),
        };
        let decided = decide_from(&mut row, lock_state, self.claim.lock.token)?;
        Ok(decided.map(|decision| Claimed {
            decision,
            key_created_at: row.created_at,
            first_phase: None,
        }))
    }

    /// The locking inspection of a key that exists ([`Self::lock_existing`]), retried on a
    /// transient error. `None` if the key was reaped meanwhile.
    pub async fn lock(&self, user_id: i64) -> Result<Option<Claimed<S::Written>>, StoreError> {
        let (pool, policy) = (self.claims.pool(), self.claims.policy());
        retry_transient(policy, || async {
            let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
            count_statement("lock");
            conn.build_transaction()
                .read_committed()
                .run(async |conn| self.lock_existing(conn, user_id).await)
                .await
        })
        .await
    }

    /// The caller and what the claim found.
    fn found(&self, row: ClaimRow<S::Written>) -> (User, KeyFound<S::Written>) {
        let found = if row.inserted {
            KeyFound::Inserted(Box::new(Claimed {
                decision: Decision::Execute(Lease {
                    key_id: row.key.id,
                    user_id: row.user.id,
                    token: self.claim.lock.token,
                    holder: row.key.lock_holder,
                    // `ride_created`: the first phase came with the key (an attempt that finds
                    // nothing written here reads it back before its next phase).
                    recovery_point: row.key.recovery_point,
                }),
                key_created_at: row.key.created_at,
                first_phase: row.written,
            }))
        } else {
            KeyFound::Existing(Box::new(row.key), row.lock_state)
        };
        (row.user, found)
    }

    /// The locking inspection of an existing key, in one READ COMMITTED transaction: the
    /// `SELECT … FOR UPDATE` serialises it with every other attempt on the key. `None` if the key
    /// was deleted (reaped) since it was seen. A key locked by this claim's own token is this
    /// claim's: an earlier statement of it committed and its answer was lost (a failover), and no
    /// other attempt has taken it over since, or the token would have changed. Another attempt's
    /// lock is taken over when the lock rule says it is not live, and counted by why.
    async fn lock_existing(
        &self,
        conn: &mut AsyncPgConnection,
        user_id: i64,
    ) -> Result<Option<Claimed<S::Written>>, StoreError> {
        let (request, lock) = (&self.claim.request, self.claim.lock);
        use idempotency_keys as keys;
        // The columns of `FoundKey`, in its order; `binds` as the claim statements compute it.
        let binds = keys::request_method
            .eq(request.method)
            .and(keys::request_path.eq(request.path))
            .and(keys::request_params.eq(&request.params));
        let found = (
            keys::id,
            keys::created_at,
            keys::lock_token,
            keys::lock_holder,
            keys::recovery_point,
            keys::response_code,
            keys::response_body,
            binds,
        );
        let existing = keys::table
            .filter(keys::user_id.eq(user_id))
            .filter(keys::idempotency_key.eq(&self.claim.key))
            .for_update()
            .select((found, lock_state_of_key(self.claim.rule)))
            .first::<(FoundKey, String)>(conn)
            .await
            .optional()?;
        let Some((mut row, state)) = existing else {
            return Ok(None);
        };
        let state = LockState::parse(&state);
        let someone_elses = held_by_another(&row, lock.token);
        let decision = if let Some(decision) = decide_from(&mut row, state, lock.token)? {
            decision
        } else {
            diesel::update(idempotency_keys::table.find(row.id))
                .filter(idempotency_keys::user_id.eq(user_id))
                .set((
                    idempotency_keys::locked_at.eq(diesel::dsl::now),
                    idempotency_keys::lock_token.eq(lock.token),
                    idempotency_keys::lock_holder.eq(lock.holder),
                    idempotency_keys::last_run_at.eq(diesel::dsl::now),
                ))
                .execute(conn)
                .await?;
            if let Some(reason) = state.takeover_reason().filter(|_| someone_elses) {
                crate::metrics::metrics()
                    .takeovers
                    .add(1, &[telemetry::attr("reason", reason)]);
                tracing::info!(key_id = row.id, reason, "took over a key's lock");
            }
            Decision::Execute(Lease {
                key_id: row.id,
                user_id,
                token: lock.token,
                holder: lock.holder,
                recovery_point: row.recovery_point,
            })
        };
        Ok(Some(Claimed {
            decision,
            key_created_at: row.created_at,
            first_phase: None,
        }))
    }
}

/// The decisions that take nothing, in the design's order of precedence: a mismatch, a replay,
/// a key in use. `None` when this claim may take the key. The one rule for the claim's read and
/// for its locking inspection.
fn decide_from(
    row: &mut FoundKey,
    lock_state: LockState,
    token: Uuid,
) -> Result<Option<Decision>, StoreError> {
    Ok(Some(if !row.binds {
        Decision::Mismatch
    } else if row.recovery_point == RecoveryPoint::Finished {
        // Taken, not cloned: a replay's body can be large, and the row is not read again.
        Decision::Replay(stored_response(
            row.response_code,
            row.response_body.take(),
        )?)
    } else if held_by_another(row, token) && lock_state.is_live() {
        Decision::InUse
    } else {
        return Ok(None);
    }))
}

/// Whether another attempt than the one with `token` holds the key's lock. A key locked by this
/// claim's own token is this claim's (its earlier statement committed and the answer was lost).
fn held_by_another(row: &FoundKey, token: Uuid) -> bool {
    row.lock_token.is_some_and(|held| held != token)
}

/// The outcome stored on a finished key (the schema guarantees both parts are present).
pub(crate) fn stored_response(
    code: Option<i32>,
    body: Option<JsonText>,
) -> Result<StoredResponse, StoreError> {
    match (code, body) {
        (Some(code), Some(body)) => Ok(StoredResponse { code, body }),
        _ => Err(StoreError::CorruptStoredResponse),
    }
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use serde_json::json;

    use super::*;

    const MINE: Uuid = Uuid::from_u128(1);
    const THEIRS: Uuid = Uuid::from_u128(2);

    fn key(lock_token: Option<Uuid>, recovery_point: RecoveryPoint) -> FoundKey {
        FoundKey {
            id: 7,
            created_at: Utc::now(),
            lock_token,
            lock_holder: None,
            recovery_point,
            response_code: None,
            response_body: None,
            binds: true,
        }
    }

    fn decided(mut row: FoundKey, state: LockState) -> Option<&'static str> {
        decide_from(&mut row, state, MINE)
            .unwrap()
            .map(|decision| decision.name())
    }

    #[test]
    fn another_attempts_live_lock_is_in_use_from_the_read_alone() {
        let held = key(Some(THEIRS), RecoveryPoint::RideCreated);
        assert_eq!(decided(held, LockState::Live), Some("in_use"));
    }

    #[test]
    fn a_key_the_claim_may_take_goes_to_the_locking_inspection() {
        let row = |token| key(token, RecoveryPoint::RideCreated);
        assert_eq!(decided(row(None), LockState::Free), None, "free");
        assert_eq!(decided(row(Some(MINE)), LockState::Live), None, "its own");
        for state in [LockState::Expired, LockState::HolderGone] {
            assert_eq!(decided(row(Some(THEIRS)), state), None, "{state:?}");
        }
    }

    #[test]
    fn a_mismatch_and_a_replay_come_before_a_lock() {
        let mut other = key(Some(THEIRS), RecoveryPoint::RideCreated);
        other.binds = false;
        assert_eq!(decided(other, LockState::Live), Some("mismatch"));
        let mut finished = key(None, RecoveryPoint::Finished);
        finished.response_code = Some(0);
        finished.response_body = Some(json!({"ride_id": 1}).into());
        assert_eq!(decided(finished, LockState::Free), Some("replay"));
        let mut finished_other = key(None, RecoveryPoint::Finished);
        finished_other.binds = false;
        assert_eq!(decided(finished_other, LockState::Free), Some("mismatch"));
    }
}
