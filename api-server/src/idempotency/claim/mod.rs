//! Claiming a key: the first step of every request. A claim inserts the key, or decides a
//! replay, a mismatch or another attempt's live lock from the row that is already there, or locks
//! and inspects that row. Every
//! decision is arbitrated by PostgreSQL: the unique index for a new key, the row lock for one that
//! may need work. The claim authenticates its caller in the same statement (the `users` row by
//! token digest or by id), so a new key, a replay or a mismatch costs one round trip, and every
//! claim goes through one [`Batcher`] with other callers' claims.
//!
//! - [`statement`]: what a request type's claim statement must do ([`ClaimStatement`]); the
//!   statement itself, which inserts the request's first phase with a new key, is the request
//!   type's (`crate::rides::claim`).
//! - [`decide`]: deciding what the statement found, and the locking inspection of a key that may
//!   need work.

mod decide;
mod statement;

use std::sync::Arc;

use chrono::{DateTime, Utc};
use contract::StoredResponse;
use diesel::{
    QueryableByName,
    sql_types::{BigInt, Bool, Bytea, Text},
};
use diesel_async::RunQueryDsl;
use schema::{Pool, models::User, store::StoreError};
use uuid::Uuid;

pub use statement::{
    CallerAndKey, ClaimRequest, ClaimRow, ClaimStatement, ClaimStatementsSent, Claims, FoundKey,
    Sends,
};

use decide::ClaimContext;
pub(crate) use decide::stored_response;

use super::{Batcher, IdempotencyKey, Lease, LockedBy, Locking, RequestSignature};
use crate::auth::Caller;

/// What a claim decided, in the order of precedence the design requires.
#[derive(Debug)]
pub enum Decision {
    /// The key was reused with different parameters.
    Mismatch,
    /// The key is finished: replay its stored outcome.
    Replay(StoredResponse),
    /// Another attempt holds a live lock on the key.
    InUse,
    /// This attempt owns the key (new, unlocked, or taken over from an expired lock) and resumes
    /// at `lease.recovery_point`.
    Execute(Lease),
}

/// A claim's decision, and when the key was first created (it expires a fixed time after that).
#[derive(Debug)]
pub struct Claimed<W> {
    pub decision: Decision,
    pub key_created_at: DateTime<Utc>,
    /// What the first phase wrote with the key if this claim inserted it (CreateRide: the ride,
    /// and the key is at `ride_created`). `None` for every other claim.
    pub first_phase: Option<W>,
}

/// The caller a claim authenticated, and what it decided.
pub type UserClaimed<W> = (User, Claimed<W>);

/// The attempt a claim is made for.
#[derive(Clone, Copy, Debug)]
pub struct Attempt {
    /// Its lock token, from its first statement on: a statement of it whose commit was lost left
    /// the key locked by it, which only this attempt can recognise or undo.
    pub token: Uuid,
    /// Whether its key most likely exists already: the caller says it sent the key before
    /// (`idempotency-key-resent`), or this attempt has found it. The claim then reads first.
    pub expects_key: bool,
}

/// Where a claim starts.
#[derive(Debug)]
pub enum ClaimStart {
    /// With its statement.
    Attempt(Attempt),
    /// With the locking inspection of a key its read found ([`ClaimRead::MayTake`]).
    Found(Box<KeyToTake>),
}

impl From<Attempt> for ClaimStart {
    fn from(attempt: Attempt) -> ClaimStart {
        ClaimStart::Attempt(attempt)
    }
}

/// A key a claim's read found and its attempt may take ([`ClaimRead::MayTake`]), with the caller
/// the read authenticated. [`claim`] goes on from it with the locking inspection, which reads the
/// row again under its lock, so the read's snapshot decides nothing.
#[derive(Debug)]
pub struct KeyToTake {
    user: User,
    attempt: Attempt,
}

/// Claims `key` for `caller`: authenticates the caller and decides the key in the claim's
/// statement, sent with other callers' claims through `claims`. `None` if the caller is no user
/// (nothing is written then). If the claim inserts the key, it writes `first_phase` with it.
/// Every lock the claim takes names this process's liveness session as its holder (`locking`),
/// and a key locked by another attempt is taken over as its rule says. A claim whose key most
/// likely exists (`attempt.expects_key`, or a claim on a user's behalf) reads before it writes
/// ([`ClaimRequest::sends`]). A claim that starts from its read ([`ClaimStart::Found`], for the
/// same caller, key, request and first phase) sends no statement before the locking inspection.
#[tracing::instrument(
    name = "claim",
    skip_all,
    fields(
        otel.name = "claim idempotency key",
        { telemetry::semconv::attribute::DB_SYSTEM_NAME } = telemetry::semconv::DB_SYSTEM_POSTGRESQL,
        rides.claim = tracing::field::Empty,
        rides.recovery_point.to = tracing::field::Empty,
    )
)]
pub async fn claim<S: ClaimStatement>(
    claims: &Arc<Batcher<Claims<S>>>,
    caller: Caller,
    key: &IdempotencyKey,
    request: &RequestSignature,
    first_phase: &S::FirstPhase,
    locking: &Locking,
    start: impl Into<ClaimStart>,
) -> Result<Option<UserClaimed<S::Written>>, StoreError> {
    let start = start.into();
    let attempt = match &start {
        ClaimStart::Attempt(attempt) => *attempt,
        ClaimStart::Found(found) => found.attempt,
    };
    let lock = LockedBy {
        token: attempt.token,
        holder: locking.liveness.holder_for_lock().await,
    };
    let sends = if attempt.reads_first(caller) {
        Sends::ReadThenWrite
    } else {
        Sends::Write
    };
    let claim = (caller, key, request, first_phase);
    let context = ClaimContext {
        claims,
        claim: claim_request(claim, locking, lock, sends),
    };
    let (user, decided) = match start {
        ClaimStart::Attempt(_) => match first_statement(&context).await? {
            Some(first) => first,
            None => return Ok(None),
        },
        ClaimStart::Found(found) => {
            let decided = context.lock(found.user.id).await?;
            (found.user, decided)
        }
    };
    let claimed = match decided {
        Some(claimed) => claimed,
        None => context.rounds(user.id).await?,
    };
    let span = tracing::Span::current();
    span.record("rides.claim", claimed.decision.name());
    if let Decision::Execute(lease) = &claimed.decision {
        // `ride_created` for a fresh key whose claim wrote its first ride.
        span.record("rides.recovery_point.to", lease.recovery_point.as_str());
    }
    Ok(Some((user, claimed)))
}

/// The claim's statement, decided where it can be: the caller, with the claim decided or `None`
/// for a key to claim again ([`ClaimContext::rounds`]); `None` if the caller is no user.
async fn first_statement<S: ClaimStatement>(
    context: &ClaimContext<'_, S>,
) -> Result<Option<(User, Option<Claimed<S::Written>>)>, StoreError> {
    if let Some((user, found)) = context.insert_or_read().await? {
        let decided = context.decide(user.id, found).await?;
        return Ok(Some((user, decided)));
    }
    // No such user, or a claim of this key that committed after the statement's snapshot
    // (rare): tell them apart with a plain read.
    let pool = context.claims.pool();
    let user = match context.claim.caller {
        Caller::OnBehalfOf(user_id) => crate::auth::user_by_id(pool, user_id).await?,
        Caller::Token(digest) => crate::auth::user_by_token_digest(pool, &digest).await?,
    };
    Ok(user.map(|user| (user, None)))
}

/// What a claim's read alone found ([`read_claim`]).
#[derive(Debug)]
pub enum ClaimRead<W> {
    /// What a read decides: a replay, a mismatch, another attempt's live lock.
    Decided(UserClaimed<W>),
    /// The key exists and this attempt may take it, which only the locking claim decides.
    MayTake(Box<KeyToTake>),
    /// No such key, or no such user: the claim's write statement decides.
    NotFound,
}

/// The read of a claim that reads first ([`Attempt::reads_first`]), alone: one read statement,
/// batched with other callers' claims, and what a read decides. It writes nothing, whatever it
/// finds (its lock names no holder and is never taken), so it may run where a caller's hang-up
/// cuts it short; [`claim`] goes on with the same `attempt`, or from the key it found, where the
/// read decides nothing.
#[tracing::instrument(
    name = "claim_read",
    skip_all,
    fields(
        otel.name = "read idempotency key",
        { telemetry::semconv::attribute::DB_SYSTEM_NAME } = telemetry::semconv::DB_SYSTEM_POSTGRESQL,
        rides.claim = tracing::field::Empty,
    )
)]
pub async fn read_claim<S: ClaimStatement>(
    claims: &Arc<Batcher<Claims<S>>>,
    caller: Caller,
    key: &IdempotencyKey,
    request: &RequestSignature,
    first_phase: &S::FirstPhase,
    locking: &Locking,
    attempt: Attempt,
) -> Result<ClaimRead<S::Written>, StoreError> {
    let lock = LockedBy {
        token: attempt.token,
        holder: None,
    };
    let claim = (caller, key, request, first_phase);
    let context = ClaimContext {
        claims,
        claim: claim_request(claim, locking, lock, Sends::Read),
    };
    let Some((user, found)) = context.insert_or_read().await? else {
        return Ok(ClaimRead::NotFound);
    };
    match context.decide_by_read(found)? {
        Some(claimed) => {
            tracing::Span::current().record("rides.claim", claimed.decision.name());
            Ok(ClaimRead::Decided((user, claimed)))
        }
        None => Ok(ClaimRead::MayTake(Box::new(KeyToTake {
            user,
            attempt: Attempt {
                expects_key: true,
                ..attempt
            },
        }))),
    }
}

/// One claim of `key` for `caller`, bound to `request`, for the batcher.
fn claim_request<F: Clone>(
    (caller, key, request, first_phase): (Caller, &IdempotencyKey, &RequestSignature, &F),
    locking: &Locking,
    lock: LockedBy,
    sends: Sends,
) -> ClaimRequest<F> {
    ClaimRequest {
        caller,
        key: key.as_str().to_owned(),
        lock,
        request: request.clone(),
        first_phase: first_phase.clone(),
        rule: locking.rule,
        sends,
    }
}

impl Attempt {
    /// Whether this attempt's claim reads before it writes: its key most likely exists, or the
    /// caller may not insert keys (a call on a user's behalf).
    pub fn reads_first(&self, caller: Caller) -> bool {
        self.expects_key || !caller.may_insert_keys()
    }
}

/// Whether `key` exists for the caller. A read only, through the `(user_id, idempotency_key)`
/// unique index: for refusing a card tester's new keys without writing anything
/// (`crate::limits`).
pub async fn key_exists(
    pool: &Pool,
    caller: Caller,
    key: &IdempotencyKey,
) -> Result<bool, StoreError> {
    #[derive(QueryableByName)]
    struct Exists {
        #[diesel(sql_type = Bool)]
        exists: bool,
    }
    let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
    let query = match caller {
        Caller::OnBehalfOf(user_id) => diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM idempotency_keys \
             WHERE user_id = $1 AND idempotency_key = $2) AS exists",
        )
        .into_boxed()
        .bind::<BigInt, _>(user_id)
        .bind::<Text, _>(key.as_str()),
        Caller::Token(digest) => diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM idempotency_keys k JOIN users u ON u.id = k.user_id \
             WHERE u.api_token_digest = $1 AND k.idempotency_key = $2) AS exists",
        )
        .into_boxed()
        .bind::<Bytea, _>(digest.to_vec())
        .bind::<Text, _>(key.as_str()),
    };
    let row: Exists = query.get_result(&mut conn).await?;
    Ok(row.exists)
}

impl Decision {
    fn name(&self) -> &'static str {
        match self {
            Decision::Mismatch => "mismatch",
            Decision::Replay(_) => "replay",
            Decision::InUse => "in_use",
            Decision::Execute(_) => "execute",
        }
    }
}

fn count_statement(step: &'static str) {
    crate::metrics::metrics()
        .claim_statements
        .add(1, &[telemetry::attr("step", step)]);
}
