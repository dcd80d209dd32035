//! Deciding a claim from what its statement found: at once for a new key, a replay or a
//! mismatch, under the key row's lock for a key that may need work.

use std::sync::Arc;

use contract::{
    StoredResponse,
    key::{LockRule, LockState, lock_state_of_key},
};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl, SelectableHelper};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{
    RecoveryPoint,
    models::{IdempotencyKeyRow as KeyRow, User},
    schema::idempotency_keys,
    store::{StoreError, retry_transient},
};

use super::{ClaimRequest, ClaimRow, ClaimStatement, Claimed, Claims, Decision, count_statement};
use crate::idempotency::{Batcher, Lease, RequestSignature};

/// How many insert/inspect rounds a claim makes before giving up on a key that keeps vanishing.
const CLAIM_ROUNDS: usize = 5;

/// One claim, for the steps after its first statement.
pub(super) struct ClaimContext<'a, S: ClaimStatement> {
    pub claims: &'a Arc<Batcher<Claims<S>>>,
    /// The lock of every statement of this claim: one that finds the key locked by its token
    /// finds its own earlier statement's lock, committed though its answer was lost.
    pub claim: ClaimRequest<S::FirstPhase>,
    pub rule: LockRule,
}

/// What a claim's statement found: the key it inserted (so this attempt owns it), or the key
/// that was already there, to be decided.
pub(super) enum KeyFound<W> {
    Inserted(Box<Claimed<W>>),
    Existing(Box<KeyRow>),
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
        // Each round pays only for what the key needs: a new key, a replay and a mismatch are one
        // statement; only a key that may need work takes the row lock. A round ends without a
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

    /// What a claim's statement found, decided: at once for a new key, a replay or a mismatch,
    /// under the row lock otherwise. `None` if the key was reaped meanwhile.
    pub async fn decide(
        &self,
        user_id: i64,
        found: KeyFound<S::Written>,
    ) -> Result<Option<Claimed<S::Written>>, StoreError> {
        let row = match found {
            KeyFound::Inserted(claimed) => return Ok(Some(*claimed)),
            KeyFound::Existing(row) => row,
        };
        if let Some(claimed) = decide_without_lock(*row, &self.claim.request)? {
            return Ok(Some(claimed));
        }
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
            KeyFound::Existing(Box::new(row.key))
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
        let existing = idempotency_keys::table
            .filter(idempotency_keys::user_id.eq(user_id))
            .filter(idempotency_keys::idempotency_key.eq(&self.claim.key))
            .for_update()
            .select((KeyRow::as_select(), lock_state_of_key(self.rule)))
            .first::<(KeyRow, String)>(conn)
            .await
            .optional()?;
        let Some((row, state)) = existing else {
            return Ok(None);
        };
        let state = LockState::parse(&state);
        let someone_elses = row.lock_token.is_some() && row.lock_token != Some(lock.token);
        let decision = if !binds(&row, request) {
            Decision::Mismatch
        } else if row.recovery_point == RecoveryPoint::Finished {
            Decision::Replay(stored_response(row.response_code, row.response_body)?)
        } else if someone_elses && state.is_live() {
            Decision::InUse
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

/// The read-only decisions of a claim. A finished key never changes again, and neither do the
/// parameters a key is bound to, so a replay or a mismatch can be decided from a plain read: no
/// row lock, no transaction id, no WAL flush. `None` for a key that may need work, which goes
/// through the locking claim.
fn decide_without_lock<W>(
    row: KeyRow,
    request: &RequestSignature,
) -> Result<Option<Claimed<W>>, StoreError> {
    let decision = if !binds(&row, request) {
        Decision::Mismatch
    } else if row.recovery_point == RecoveryPoint::Finished {
        Decision::Replay(stored_response(row.response_code, row.response_body)?)
    } else {
        return Ok(None);
    };
    Ok(Some(Claimed {
        decision,
        key_created_at: row.created_at,
        first_phase: None,
    }))
}

/// The outcome stored on a finished key (the schema guarantees both parts are present).
pub(crate) fn stored_response(
    code: Option<i32>,
    body: Option<serde_json::Value>,
) -> Result<StoredResponse, StoreError> {
    match (code, body) {
        (Some(code), Some(body)) => Ok(StoredResponse { code, body }),
        _ => Err(StoreError::CorruptStoredResponse),
    }
}

/// Whether `row` was created for exactly this request.
fn binds(row: &KeyRow, request: &RequestSignature) -> bool {
    row.request_method == request.method
        && row.request_path == request.path
        && row.request_params == request.params
}
