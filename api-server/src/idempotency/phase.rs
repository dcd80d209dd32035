//! Atomic phases: each is ONE SQL statement, run outside any explicit transaction (so in its own
//! implicit READ COMMITTED transaction, which commits the phase's writes and the key's recovery
//! point together), that starts with the key's fence (`contract::fence!`, or
//! `contract::batch_fence!` for a batch) and returns a row only if the fence passed. One statement
//! is one round trip: the key row's lock is held only while PostgreSQL executes it, never while
//! this process waits for a CPU between statements.
//!
//! The phases of a particular request type (CreateRide's in `crate::rides`) bring their own
//! statements; the two every key shares, finishing with a stored outcome and releasing the lock,
//! are here.

use std::{future::Future, sync::Arc};

use chrono::{DateTime, Utc};
use contract::{
    StoredResponse,
    key::{FinishKey, KeyMoved},
};
use diesel::{
    ExpressionMethods, OptionalExtension,
    result::Error as DieselError,
    sql_types::{self, BigInt, Integer, Jsonb},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::FutureExt;
use schema::{
    Pool,
    prepared::prepared,
    schema::idempotency_keys,
    store::{ConflictRetry, StoreError, lost_connection_discarded, retry_transient},
};
use scoped_futures::{ScopedBoxFuture, ScopedFutureExt};
use uuid::Uuid;

use crate::fault::CrashPoint;

use super::{BatchStatement, Batcher, Lease};

/// Runs one atomic phase: `statement` is the phase's one fenced statement. No row back means
/// this lease no longer owns the key: [`StoreError::LockLost`], and nothing was written.
/// Transient conflicts re-run the statement; a failed run was rolled back whole.
pub async fn atomic_phase<'a, T, F>(
    pool: &Pool,
    policy: ConflictRetry,
    lease: &'a Lease,
    statement: F,
) -> Result<T, StoreError>
where
    T: Send + 'a,
    F: for<'c> Fn(
            &'c mut AsyncPgConnection,
        ) -> ScopedBoxFuture<'a, 'c, Result<Option<T>, DieselError>>
        + Send
        + Sync
        + 'a,
{
    let statement = &statement;
    retry_transient(policy, || async move {
        let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
        // The phase's work is decided; it becomes durable when this statement commits.
        crash_around(lease, false);
        let done = statement(&mut conn)
            .await
            .map_err(|error| lost_connection_discarded(&mut conn, error))?
            .ok_or(StoreError::LockLost)?;
        crash_around(lease, true);
        Ok(done)
    })
    .await
}

/// An atomic phase sent through `batcher` together with other requests' same phase, or `alone`
/// (an [`atomic_phase`]) when batching is off or the batch could not decide it. The batch
/// statement fences every request as the one-request statement does; `None` for a request means
/// its fence failed and nothing of it was written. The crash points fire as around
/// [`atomic_phase`]'s statement.
pub async fn batched_phase<S, T, Fut>(
    batcher: &Arc<Batcher<S>>,
    lease: &Lease,
    item: impl FnOnce() -> S::Item,
    alone: impl FnOnce() -> Fut,
) -> Result<T, StoreError>
where
    S: BatchStatement<Output = Option<T>>,
    Fut: Future<Output = Result<T, StoreError>>,
{
    if batcher.enabled() {
        crash_around(lease, false);
        if let Some(decided) = batcher.submit(item()).await? {
            let done = decided.ok_or(StoreError::LockLost)?;
            crash_around(lease, true);
            return Ok(done);
        }
    }
    alone().await
}

/// The crash point around the commit of the phase `lease` is at (`committed`: after it).
fn crash_around(lease: &Lease, committed: bool) {
    if let Some(point) = CrashPoint::around_phase(lease.recovery_point, committed) {
        crate::fault::crash_point(point);
    }
}

/// Finishes the key with `response` and nothing else (a final outcome reached without further
/// writes, such as a declined card), as the atomic phase of `lease.recovery_point`: the same
/// statement `workers admin key finish` runs.
pub async fn finish(
    pool: &Pool,
    policy: ConflictRetry,
    lease: &Lease,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    atomic_phase(pool, policy, lease, |conn| {
        prepared::<FinishKey, _>(|q| {
            q.bind::<BigInt, _>(lease.key_id)
                .bind::<sql_types::Uuid, _>(lease.token)
                .bind::<BigInt, _>(lease.user_id)
                .bind::<Integer, _>(response.code)
                .bind::<Jsonb, _>(&response.body)
        })
        .get_result::<KeyMoved>(conn)
        .map(OptionalExtension::optional)
        .scope_boxed()
    })
    .await
    .map(|_| ())
}

/// The columns [`unlocked`] sets.
type Unlocked = (
    diesel::dsl::Eq<idempotency_keys::locked_at, Option<DateTime<Utc>>>,
    diesel::dsl::Eq<idempotency_keys::lock_token, Option<Uuid>>,
    diesel::dsl::Eq<idempotency_keys::lock_holder, Option<i64>>,
);

/// The assignment that unlocks a key: every unlock, fenced by its token, sets this.
pub(super) fn unlocked() -> Unlocked {
    (
        idempotency_keys::locked_at.eq(None),
        idempotency_keys::lock_token.eq(None),
        idempotency_keys::lock_holder.eq(None),
    )
}

/// Unlocks a key this attempt still owns so that a retry may continue at once, without waiting
/// for the lock to expire. Releasing a lease that was taken over changes nothing.
pub async fn release(
    pool: &Pool,
    policy: ConflictRetry,
    lease: &Lease,
) -> Result<bool, StoreError> {
    retry_transient(policy, || async {
        let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
        let updated = diesel::update(idempotency_keys::table)
            .filter(idempotency_keys::id.eq(lease.key_id))
            .filter(idempotency_keys::user_id.eq(lease.user_id))
            .filter(idempotency_keys::lock_token.eq(lease.token))
            .set(unlocked())
            .execute(&mut conn)
            .await?;
        Ok(updated == 1)
    })
    .await
}
