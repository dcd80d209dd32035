//! The writes that move a key on and that more than one process makes: the api-server's phases,
//! and `workers admin` when an operator finishes or unlocks a stuck key. Each is one SQL
//! statement in a `.sql` file beside its Rust struct, which binds its parameters by name
//! (`schema::statement!`), over arrays with one element per key: one key is a batch of one,
//! so the api-server's batched phases, its lone requests and the operator run the same text.
//!
//! - [`record_charge`]: the charge recorded on the ride, the receipt staged and the key
//!   finished with its outcome, in one commit (phase `ride_created`; `workers admin key finish
//!   --outcome succeeded`). The only statement that inserts a `staged_jobs` row.
//! - [`finish_key`]: the key finished with a stored outcome and nothing else (a declined card, a
//!   refunded charge, `key finish --outcome declined`).
//! - [`release_lock`]: the key's lock released so that a retry resumes at once (a failed
//!   attempt, `workers admin key unlock`). The only statement that unlocks a key without
//!   finishing it.
//!
//! # The fence
//! The statements that move a key on (the record, the finish) start by locking each key row
//! (`FOR NO KEY UPDATE`, in key id order, so two batches never wait for each other in a cycle)
//! and keep a key only while its row still
//! carries the caller's lock token and user id (and, for a phase, still stands at the recovery
//! point the caller moves it on from). Every write of the statement selects from what the fence
//! kept, so a holder whose lock was taken over writes nothing and gets no row back, while the
//! other keys of its batch commit. The row lock is held until the statement commits, so two
//! attempts on one key move it one after the other; a concurrent takeover makes the fence wait
//! for it and then re-check the token on the newest row version (READ COMMITTED's re-check of
//! locked rows), so it is never missed. A phase names where it moves the key on from because a
//! holder whose idea of the key were ahead of the database's (a commit it saw lost) would
//! otherwise write on a state it never saw. The release writes one column set on the key row
//! alone, so it needs no separate lock: its `UPDATE` matches the token, and READ COMMITTED
//! re-checks that match on the newest row version after any concurrent takeover.
//!
//! Lookups go through `= ANY(…)` over the input's ids so that the generic plan, which cannot
//! know how many keys a batch holds, stays one index probe per key.

mod finish_key;
mod record_charge;
mod release_lock;

use std::collections::HashSet;

use diesel::{QueryableByName, sql_types::BigInt};
use uuid::Uuid;

pub use finish_key::{FinishKey, KeyFinish};
pub use record_charge::{ChargeRecord, RecordCharge};
pub use release_lock::ReleaseLock;

/// Which key a write moves on, whose it is, and the lock token its fence checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyFence {
    pub key_id: i64,
    pub user_id: i64,
    pub token: Uuid,
}

/// What a statement here returns for each key it moved on: the key, and the token its fence
/// passed with (two attempts on one key can share a batch; only the holder's token passes).
#[derive(QueryableByName)]
pub struct KeyMoved {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = diesel::sql_types::Uuid)]
    pub token: Uuid,
}

/// For each of `fences`, in order, whether the statement moved its key on with its token
/// (`false`: its fence failed and nothing of it was written).
pub fn moved_per_key(fences: impl Iterator<Item = KeyFence>, moved: Vec<KeyMoved>) -> Vec<bool> {
    let moved: HashSet<(i64, Uuid)> = moved.into_iter().map(|key| (key.id, key.token)).collect();
    fences
        .map(|fence| moved.contains(&(fence.key_id, fence.token)))
        .collect()
}

/// The `key_ids`, `tokens` and `user_ids` arrays of a statement here, one element per key.
fn fence_arrays(fences: impl Iterator<Item = KeyFence>) -> (Vec<i64>, Vec<Uuid>, Vec<i64>) {
    let mut arrays = (Vec::new(), Vec::new(), Vec::new());
    for fence in fences {
        arrays.0.push(fence.key_id);
        arrays.1.push(fence.token);
        arrays.2.push(fence.user_id);
    }
    arrays
}
