//! The idempotency engine: claiming a key, running atomic phases that are fenced by the claim,
//! and releasing a key. `crate::rides` drives it through the CreateRide phases; the gRPC layer
//! never calls it directly.
//!
//! What it knows beyond `idempotency_keys`: a claim authenticates its caller in the same
//! statement (the `users` row by token digest or id, so a new key, a replay or a mismatch costs
//! one round trip), and the crash points around each phase's commit are named after the key's
//! recovery points (`schema::RecoveryPoint`). It knows nothing of charges, rides or gRPC: a
//! request type brings its claim statement, which writes its first phase with a new key
//! ([`ClaimStatement`]), and its phases' statements.
//!
//! Layout:
//! - [`key`]: the validated key string.
//! - [`claim`]: the claim, batched with other callers' claims (a claim alone is a batch of one).
//! - [`phase`]: the fenced atomic phase, and the two writes every key shares (finishing with a
//!   stored outcome, releasing the lock: `contract::writes`).
//! - [`batch`]: sending concurrent requests' statements of one kind together.
//! - [`wait`]: a duplicate's wait for the attempt in flight on its key, woken by that attempt on
//!   this process, polling the key row across processes.
//! - [`unlock`]: unlocking in the background a key left locked when the database was unreachable
//!   (a failed phase's lease, or a failed claim that may have committed).
//! - Database errors and the transient-retry policy are `schema::store`'s, shared by every crate.
//!
//! # Isolation level
//! Every transaction here runs at READ COMMITTED. What must be serialised is all the work done
//! for one key, and that is done explicitly: each phase is one statement (its own implicit
//! transaction) whose first step takes the key row's lock (`SELECT … FOR NO KEY UPDATE`) and
//! checks its fencing token, and whose writes all depend on that step (the fence,
//! `contract::writes`), so
//! two attempts on one key run their phases strictly one after the other, and an attempt whose
//! lock was taken over finds its token gone and commits nothing. Work on different keys shares no
//! rows that need to be read consistently, so SERIALIZABLE would only add false conflicts (the
//! seed's design loses most of its throughput to them under concurrency). The schema backs this
//! up with constraints (one ride per key, one key per user and key string, a closed set of
//! recovery points). Serialization failures and deadlocks can still surface (for instance from a
//! future migration or an operator's transaction), so phases retry them, bounded and with jitter.

mod batch;
pub mod claim;
mod key;
pub mod phase;
mod unlock;
pub mod wait;

use contract::{key::LockRule, writes::KeyFence};
use schema::{
    RecoveryPoint,
    liveness::{HolderId, Liveness},
};
use uuid::Uuid;

pub use batch::{BatchCounts, BatchStatement, Batcher, Batching};
pub use claim::{
    Attempt, CallerAndKey, ClaimRead, ClaimRequest, ClaimRow, ClaimStart, ClaimStatement,
    ClaimStatementsSent, Claimed, Claims, Decision, KeyToTake, Sends, UserClaimed, claim,
    key_exists, read_claim,
};
pub use key::{IdempotencyKey, InvalidKey, MAX_LEN, MIN_LEN};
pub use phase::{finish, phase, release};
pub use unlock::Unlock;
pub use wait::{Holding, WaitBudget, WaitConfig, WaitEnd, Waits};

/// What identifies a request beyond its key: a key reused for anything else is refused.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSignature {
    pub method: &'static str,
    pub path: &'static str,
    pub params: schema::JsonText,
}

/// Proof that this attempt owns a key. Every phase checks `token` against the row in its own
/// transaction; the holder of an older token can no longer commit.
#[derive(Clone, Debug)]
pub struct Lease {
    pub key_id: i64,
    pub user_id: i64,
    pub token: Uuid,
    /// The liveness session the lock names (`schema::liveness`), if it named one: the attempt
    /// starts no provider call unless that session is confirmed, and records nothing once it
    /// knows the session is gone.
    pub holder: Option<HolderId>,
    pub recovery_point: RecoveryPoint,
}

/// How this process takes key locks: the holder its locks name (its liveness session), and when
/// another attempt's lock may be taken over.
#[derive(Clone, Debug)]
pub struct Locking {
    pub liveness: Liveness,
    pub rule: LockRule,
}

/// The lock one claim takes: its fencing token, and the holder id it names (`None` while this
/// process has no liveness session: the lock is then judged by the timeout alone).
#[derive(Clone, Copy, Debug)]
pub struct LockedBy {
    pub token: Uuid,
    pub holder: Option<HolderId>,
}

impl Lease {
    /// What the fence of a write on this key checks.
    pub fn fence(&self) -> KeyFence {
        KeyFence {
            key_id: self.key_id,
            user_id: self.user_id,
            token: self.token,
        }
    }
}
