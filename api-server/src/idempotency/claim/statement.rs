//! The claim's statement, as the engine sees it: a request type brings one SQL statement that
//! claims keys for several callers at once (CreateRide's is `crate::rides::claim`), and the engine
//! batches it, reads its rows and decides each claim. A claim alone is a batch of one.
//!
//! What every claim statement must do, row for row, so that batching changes no decision: for
//! each claim, authenticate the caller (a token's digest, or a user id for a call on a user's
//! behalf, which never inserts a key); return the key as [`FoundKey`] if it exists, with its
//! lock's state by the claim's rule and whether it binds the claim's request (a replay, a
//! mismatch, or another attempt's live lock is decided from it without a lock; only a key that
//! may need work is locked and inspected again); otherwise insert the key, locked by the
//! claim's fresh token and naming its holder, with the request type's first phase in the same
//! statement. `ON CONFLICT DO NOTHING` waits for a concurrent inserter of the same key and then
//! yields to it; that key is newer than the statement's snapshot, so no row comes back and the
//! claim looks again. Two claims of one key in one batch cannot both win: the row is inserted
//! once, and only the claim whose token it carries gets it back. Keys are inserted in (user,
//! key) order so that two batches that share keys wait for each other in one order and cannot
//! deadlock. A replay writes nothing and burns no sequence value.
//!
//! A request type also brings the same statement without its writes ([`ClaimStatement::read`]).
//! A write statement costs PostgreSQL more than its reads alone even when it writes nothing (it
//! locks and opens every table and index it could write: 0.13–0.25 ms a statement, measured by
//! `bench/claim_writes.sh`), so a claim whose key most likely exists
//! ([`ClaimRequest::sends`]) is read first, and written only if it finds no key: a found key
//! costs one read statement, a key not found one statement more than without the hint. A claim
//! that only reads ([`Sends::Read`]) writes nothing, whatever it finds.

use std::{
    future::Future,
    sync::atomic::{AtomicU64, Ordering},
};

use chrono::{DateTime, Utc};
use contract::key::{LockRule, LockState};
use diesel::{
    Queryable, QueryableByName,
    result::Error as DieselError,
    sql_types::{
        BigInt, Bool, Bytea, Integer, Jsonb, Nullable, Text, Timestamptz, Uuid as SqlUuid,
    },
};
use diesel_async::AsyncPgConnection;
use schema::{JsonText, RecoveryPoint, models::User};
use uuid::Uuid;

use crate::{
    auth::Caller,
    idempotency::{BatchStatement, LockedBy, RequestSignature},
};

/// A request type's claim statement.
pub trait ClaimStatement: Send + Sync + 'static {
    /// What a fresh key's first phase writes with the key (CreateRide: its ride).
    type FirstPhase: Clone + Send + Sync + 'static;
    /// What the statement returns of that phase for a key it inserted.
    type Written: Send + 'static;

    /// Claims each of `claims`, returning per claim, in order, its row, or `None` for a caller
    /// that is no user or a key a concurrent claim inserted after the statement's snapshot.
    fn execute<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        claims: &'a [ClaimRequest<Self::FirstPhase>],
    ) -> impl Future<Output = Result<Vec<Option<ClaimRow<Self::Written>>>, DieselError>> + Send + 'a;

    /// The same claims without the writes: per claim, in order, the key it finds with its lock's
    /// state, or `None` for a key (or caller) not found, and nothing inserted. For claims whose
    /// key most likely exists ([`ClaimRequest::sends`]): a write statement costs
    /// PostgreSQL more than the same reads even when it writes nothing.
    fn read<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        claims: &'a [ClaimRequest<Self::FirstPhase>],
    ) -> impl Future<Output = Result<Vec<Option<ClaimRow<Self::Written>>>, DieselError>> + Send + 'a;
}

/// One claim: who, which key, the lock it takes, the request the key is bound to, and the first
/// phase it writes if it inserts the key.
#[derive(Clone, Debug)]
pub struct ClaimRequest<F> {
    pub caller: Caller,
    pub key: String,
    /// Also how the claim finds its row in the batch's result: the token is fresh per claim.
    pub lock: LockedBy,
    pub request: RequestSignature,
    pub first_phase: F,
    /// How the statement judges the lock of a key it finds.
    pub rule: LockRule,
    /// Which statements the claim sends. A hint: it decides no answer.
    pub sends: Sends,
}

/// Which of its statements a claim sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sends {
    /// The write statement alone: the key is most likely new.
    Write,
    /// The read first ([`ClaimStatement::read`]), and the write statement only if it found no
    /// key and the caller may insert one: the key most likely exists (its caller sent it before,
    /// the claim is on a user's behalf, or this attempt has already found it).
    ReadThenWrite,
    /// The read alone, whatever it finds ([`super::read_claim`]): nothing is written, so the
    /// claim may be cut short at any point.
    Read,
}

impl<F> ClaimRequest<F> {
    fn reads(&self) -> bool {
        self.sends != Sends::Write
    }

    /// Whether a claim whose read found no key goes on to the write statement.
    fn writes_after_read(&self) -> bool {
        self.sends == Sends::ReadThenWrite && self.caller.may_insert_keys()
    }
}

/// What a claim statement returns for one claim.
pub struct ClaimRow<W> {
    pub user: User,
    pub key: FoundKey,
    /// The found key's lock by the claim's rule (`Live` for a key this claim inserted).
    pub lock_state: LockState,
    /// This claim inserted the key: it holds it, with its own lock token.
    pub inserted: bool,
    /// What the first phase wrote with a key this claim inserted.
    pub written: Option<W>,
}

/// The key as a claim decides it: the columns of its row that a decision reads, and whether the
/// row binds the claim's request (method, path and parameters equal). PostgreSQL compares the
/// stored parameters with the request's (`jsonb` equality), so they never travel back to be
/// decoded: a replay's row carries only its stored outcome. The claim's statement and its
/// locking inspection both return this.
#[derive(Debug, Queryable, QueryableByName)]
pub struct FoundKey {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<SqlUuid>)]
    pub lock_token: Option<Uuid>,
    /// The liveness session of the lock's holder, if it named one.
    #[diesel(sql_type = Nullable<BigInt>)]
    pub lock_holder: Option<i64>,
    #[diesel(sql_type = Text)]
    pub recovery_point: RecoveryPoint,
    #[diesel(sql_type = Nullable<Integer>)]
    pub response_code: Option<i32>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    pub response_body: Option<JsonText>,
    /// The key was made for exactly this request; `false` is a mismatch.
    #[diesel(sql_type = Bool)]
    pub binds: bool,
}

/// The columns every claim statement returns for the caller, the key and the claim they answer
/// (`req`, the claim's lock token); a request type's row embeds it.
#[derive(QueryableByName)]
pub struct CallerAndKey {
    #[diesel(sql_type = SqlUuid)]
    pub req: Uuid,
    #[diesel(sql_type = BigInt)]
    caller_id: i64,
    #[diesel(sql_type = Timestamptz)]
    caller_created_at: DateTime<Utc>,
    #[diesel(sql_type = Text)]
    email: String,
    #[diesel(sql_type = Text)]
    stripe_customer_id: String,
    #[diesel(sql_type = Text)]
    stripe_payment_method_id: String,
    #[diesel(sql_type = Bytea)]
    api_token_digest: Vec<u8>,
    #[diesel(embed)]
    key: FoundKey,
    #[diesel(sql_type = Bool)]
    inserted: bool,
    #[diesel(sql_type = Text)]
    lock_state: String,
}

impl CallerAndKey {
    /// The claim's row, with what its first phase wrote.
    pub fn into_row<W>(self, written: Option<W>) -> ClaimRow<W> {
        ClaimRow {
            user: User {
                id: self.caller_id,
                created_at: self.caller_created_at,
                email: self.email,
                stripe_customer_id: self.stripe_customer_id,
                stripe_payment_method_id: self.stripe_payment_method_id,
                api_token_digest: self.api_token_digest,
            },
            key: self.key,
            lock_state: LockState::parse(&self.lock_state),
            inserted: self.inserted,
            written,
        }
    }
}

/// A request type's claim statement, batched ([`crate::idempotency::Batcher`]), and how many of
/// its read and write statements the batches have sent.
pub struct Claims<S> {
    statement: S,
    reads: AtomicU64,
    writes: AtomicU64,
}

/// How many statements of each kind a claim statement's batches have sent: a batch sends at most
/// one read and one write statement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClaimStatementsSent {
    pub reads: u64,
    pub writes: u64,
}

impl<S: ClaimStatement> Claims<S> {
    pub fn new(statement: S) -> Claims<S> {
        Claims {
            statement,
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
        }
    }

    pub fn sent(&self) -> ClaimStatementsSent {
        ClaimStatementsSent {
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
        }
    }

    /// A batch's claims, each by the statement its key calls for: the claims that read
    /// ([`ClaimRequest::sends`]) by [`ClaimStatement::read`], and then, by the write statement,
    /// the rest with those of them that found no key and may insert one (a caller by token that
    /// does not only read; a claim on a user's behalf never inserts). A batch of claims that do
    /// not read first is the write statement alone, as before. The read commits nothing, so a
    /// batch run again (a failed batch's claims alone, a connection lost) reads again and decides
    /// the same.
    async fn reads_first(
        &self,
        conn: &mut AsyncPgConnection,
        claims: &[ClaimRequest<S::FirstPhase>],
    ) -> Result<Vec<Option<ClaimRow<S::Written>>>, DieselError> {
        if !claims.iter().any(ClaimRequest::reads) {
            return self.write(conn, claims).await;
        }
        let mut rows: Vec<Option<ClaimRow<S::Written>>> = claims.iter().map(|_| None).collect();
        let (readers, mut writers): (Vec<usize>, Vec<usize>) =
            (0..claims.len()).partition(|&i| claims[i].reads());
        self.reads.fetch_add(1, Ordering::Relaxed);
        let found = self.statement.read(conn, &subset(claims, &readers)).await?;
        for (&i, row) in readers.iter().zip(found) {
            match row {
                Some(row) => rows[i] = Some(row),
                None if claims[i].writes_after_read() => writers.push(i),
                None => {}
            }
        }
        if !writers.is_empty() {
            writers.sort_unstable();
            let written = self.write(conn, &subset(claims, &writers)).await?;
            for (&i, row) in writers.iter().zip(written) {
                rows[i] = row;
            }
        }
        Ok(rows)
    }

    async fn write(
        &self,
        conn: &mut AsyncPgConnection,
        claims: &[ClaimRequest<S::FirstPhase>],
    ) -> Result<Vec<Option<ClaimRow<S::Written>>>, DieselError> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.statement.execute(conn, claims).await
    }
}

impl<S: ClaimStatement> BatchStatement for Claims<S> {
    type Item = ClaimRequest<S::FirstPhase>;
    type Output = Option<ClaimRow<S::Written>>;
    const NAME: &'static str = "claim";
    /// A claim run again after a batch that did commit finds its key, locked by the token the
    /// batch gave it, which the claim presents again: it goes on as the key's owner, and never
    /// makes a second key.
    const REDO_AFTER_CONNECTION_LOSS: bool = true;

    fn execute<'a>(
        &'a self,
        conn: &'a mut AsyncPgConnection,
        items: &'a [Self::Item],
    ) -> impl Future<Output = Result<Vec<Self::Output>, DieselError>> + Send + 'a {
        self.reads_first(conn, items)
    }
}

/// The claims at `places`, borrowed when that is all of them.
fn subset<'a, F: Clone>(
    claims: &'a [ClaimRequest<F>],
    places: &[usize],
) -> std::borrow::Cow<'a, [ClaimRequest<F>]> {
    if places.len() == claims.len() {
        std::borrow::Cow::Borrowed(claims)
    } else {
        std::borrow::Cow::Owned(places.iter().map(|&i| claims[i].clone()).collect())
    }
}
