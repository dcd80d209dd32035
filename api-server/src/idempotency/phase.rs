//! Atomic phases: each is ONE SQL statement, run outside any explicit transaction (so in its own
//! implicit READ COMMITTED transaction, which commits the phase's writes and the key's recovery
//! point together), that starts with the key's fence (`contract::writes`) and returns a row only
//! if the fence passed. One statement is one round trip: the key row's lock is held only while
//! PostgreSQL executes it, never while this process waits for a CPU between statements.
//!
//! A request type's phases bring their own statements (CreateRide's in `crate::rides`) and run
//! them with [`phase`]; the two writes every key shares, finishing with a stored outcome and
//! releasing the lock, are here.

use contract::{
    StoredResponse,
    writes::{FinishKey, KeyFence, KeyFinish, ReleaseLock},
};
use schema::{
    Pool,
    store::{ConflictRetry, StoreError, lost_connection_discarded, retry_transient},
};

use super::{BatchStatement, Batcher, Lease};
use crate::fault::CrashPoint;

/// Runs the atomic phase of `lease.recovery_point`: `item` through `statement`'s batcher (with
/// other requests' same phase, or alone). `None` from the statement means this lease no longer
/// owns the key: [`StoreError::LockLost`], and nothing was written. The crash points of the
/// phase's commit fire around it.
pub async fn phase<S, T>(
    statement: &Batcher<S>,
    lease: &Lease,
    item: S::Item,
) -> Result<T, StoreError>
where
    S: BatchStatement<Output = Option<T>>,
{
    // The phase's work is decided; it becomes durable when this statement commits.
    crash_around(lease, false);
    let done = statement.run(item).await?.ok_or(StoreError::LockLost)?;
    crash_around(lease, true);
    Ok(done)
}

/// The crash point around the commit of the phase `lease` is at (`committed`: after it).
fn crash_around(lease: &Lease, committed: bool) {
    if let Some(point) = CrashPoint::around_phase(lease.recovery_point, committed) {
        crate::fault::crash_point(point);
    }
}

/// Finishes the key with `response` and nothing else (a final outcome reached without further
/// writes, such as a declined card), as the atomic phase of `lease.recovery_point`: the
/// statement `workers admin key finish` runs too ([`FinishKey`]).
pub async fn finish(
    pool: &Pool,
    policy: ConflictRetry,
    lease: &Lease,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let key = [KeyFinish {
        fence: lease.fence(),
        outcome: response.clone(),
    }];
    crash_around(lease, false);
    let finished = retry_transient(policy, || async {
        let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
        let finished = FinishKey::run(&mut conn, &key).await;
        finished.map_err(|error| lost_connection_discarded(&mut conn, error))
    })
    .await?;
    if finished != [true] {
        return Err(StoreError::LockLost);
    }
    crash_around(lease, true);
    Ok(())
}

/// Unlocks a key this attempt still owns so that a retry may continue at once, without waiting
/// for the lock to expire ([`ReleaseLock`], the statement every unlock runs). Releasing a lease
/// that was taken over changes nothing.
pub async fn release(
    pool: &Pool,
    policy: ConflictRetry,
    lease: &Lease,
) -> Result<bool, StoreError> {
    release_key(pool, policy, lease.fence()).await
}

/// [`release`] for a key known by its fence.
pub(super) async fn release_key(
    pool: &Pool,
    policy: ConflictRetry,
    fence: KeyFence,
) -> Result<bool, StoreError> {
    let key = [fence];
    let released = retry_transient(policy, || async {
        let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
        let released = ReleaseLock::run(&mut conn, &key).await;
        released.map_err(|error| lost_connection_discarded(&mut conn, error))
    })
    .await?;
    Ok(released == [true])
}
