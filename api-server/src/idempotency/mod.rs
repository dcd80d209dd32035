//! The idempotency engine: claiming a key, running atomic phases that are fenced by the claim,
//! retrying transient database conflicts, and releasing a key. It knows nothing of rides or of
//! gRPC; `crate::rides` drives it through the CreateRide phases.
//!
//! # Isolation level
//! Every transaction here runs at READ COMMITTED. What must be serialised is all the work done
//! for one key, and that is done explicitly: each phase is one statement (its own implicit
//! transaction) whose first step takes the key row's lock (`SELECT … FOR NO KEY UPDATE`) and
//! checks its fencing token, and whose writes all depend on that step ([`fence`]), so two
//! attempts on one key run their phases strictly one after the other, and an attempt whose lock
//! was taken over finds its token gone and commits nothing. Work on different keys shares no rows
//! that need to be read consistently, so SERIALIZABLE would only add false conflicts (the seed's
//! design loses most of its throughput to them under concurrency). The schema backs this up with
//! constraints (one ride per key, one key per user and key string, a closed set of recovery
//! points). Serialization failures and deadlocks can still surface (for instance from a future
//! migration or an operator's transaction), so phases retry them, bounded and with jitter.

mod batch;
mod key;

use std::{future::Future, sync::Arc, time::Duration};

use chrono::{DateTime, Utc};
use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl, QueryableByName, SelectableHelper,
    result::{DatabaseErrorKind, Error as DieselError},
    sql_types::{self, BigInt, Bool, Bytea, Integer, Jsonb, Text, Timestamptz},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::FutureExt;
use rand::Rng;
use schema::{
    Pool, PoolError, RecoveryPoint,
    models::{IdempotencyKey as KeyRow, User},
    prepared::{Statement, prepared},
    schema::idempotency_keys,
};
use scoped_futures::{ScopedBoxFuture, ScopedFutureExt};
use uuid::Uuid;

pub use batch::{BatchCounts, BatchStatement, Batcher, Batching};
pub use claims::{ClaimBatch, ClaimBatcher};
pub use key::{IdempotencyKey, InvalidKey, MAX_LEN, MIN_LEN};

/// What identifies a request beyond its key: a key reused for anything else is refused.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSignature {
    pub method: &'static str,
    pub path: &'static str,
    pub params: serde_json::Value,
}

/// Proof that this attempt owns a key. Every phase checks `token` against the row in its own
/// transaction; the holder of an older token can no longer commit.
#[derive(Clone, Debug)]
pub struct Lease {
    pub key_id: i64,
    pub user_id: i64,
    pub token: Uuid,
    pub recovery_point: RecoveryPoint,
}

/// A final outcome stored on a finished key, replayed as it was first answered.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredResponse {
    pub code: i32,
    pub body: serde_json::Value,
}

/// What the claim decided, in the order of precedence the design requires.
#[derive(Debug)]
pub enum Claim {
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

#[derive(Debug)]
pub struct Claimed {
    pub claim: Claim,
    /// When the key was first created; it expires a fixed time after that.
    pub key_created_at: DateTime<Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("this attempt no longer holds the idempotency key's lock")]
    LockLost,
    #[error("gave up after {attempts} attempts that hit serialization failures or deadlocks")]
    Contended {
        attempts: u32,
        #[source]
        source: DieselError,
    },
    #[error("no database connection became available")]
    Unavailable(#[source] PoolError),
    #[error("the stored outcome of a finished key is unreadable")]
    CorruptStoredResponse,
    #[error("the idempotency key kept disappearing while it was being claimed")]
    KeyVanished,
    /// The server went away mid-conversation (restart, failover, network): worth a retry, like
    /// an empty pool, and not an internal error.
    #[error("the database connection was lost")]
    ConnectionLost(#[source] DieselError),
    #[error("database error")]
    Database(#[source] DieselError),
}

impl From<DieselError> for StoreError {
    fn from(error: DieselError) -> StoreError {
        if is_connection_loss(&error) {
            StoreError::ConnectionLost(error)
        } else {
            StoreError::Database(error)
        }
    }
}

/// True when the error says the connection, not the statement, failed: a closed connection,
/// SQLSTATE class 08 (connection exception) or 57P01..57P03 (the server is shutting down or
/// starting up).
pub fn is_connection_loss(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(DatabaseErrorKind::ClosedConnection, _)
        | DieselError::BrokenTransactionManager => true,
        DieselError::DatabaseError(_, info) => {
            let message = info.message();
            message.starts_with("terminating connection due to administrator command")
                || message.starts_with("the database system is shutting down")
                || message.starts_with("the database system is starting up")
                || message.starts_with("connection closed")
                || message.contains("server closed the connection unexpectedly")
        }
        _ => false,
    }
}

/// `error` as a [`StoreError`]; if it says the connection was lost, `conn` is also marked so that
/// the pool discards it rather than handing it to the next request, which a retry right after
/// the loss would otherwise likely get back.
fn lost_connection_discarded(conn: &mut AsyncPgConnection, error: DieselError) -> StoreError {
    let error = StoreError::from(error);
    if matches!(error, StoreError::ConnectionLost(_)) {
        schema::pool::discard_on_return(conn);
    }
    error
}

/// How often and how patiently a transaction that hit a serialization failure or deadlock is
/// run again.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub base_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 6,
            base_delay: Duration::from_millis(5),
        }
    }
}

/// True for errors that say "run the whole transaction again": SQLSTATE 40001 and 40P01.
pub fn is_transient(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        // diesel has no kind for 40P01; its message is fixed by PostgreSQL.
        DieselError::DatabaseError(_, info) => info.message().starts_with("deadlock detected"),
        _ => false,
    }
}

/// Runs `run` (one whole transaction) until it succeeds, fails for a reason other than a
/// serialization failure or deadlock, or `policy` is exhausted. Backoff is exponential with full
/// jitter so that the transactions that collided do not collide again.
pub async fn retry_transient<T, F, Fut>(policy: RetryPolicy, mut run: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut attempt = 1;
    loop {
        match run().await {
            Err(StoreError::Database(error)) if is_transient(&error) => {
                if attempt >= policy.max_attempts {
                    return Err(StoreError::Contended {
                        attempts: attempt,
                        source: error,
                    });
                }
                let ceiling = policy.base_delay.saturating_mul(1 << attempt.min(10));
                let delay = rand::rng().random_range(Duration::ZERO..=ceiling);
                tracing::debug!(attempt, ?delay, "retrying a transaction after a conflict");
                crate::metrics::metrics().serialization_retries.add(1, &[]);
                tokio::time::sleep(delay).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// Claims `key` for `user_id`: inserts it, or decides a replay or a mismatch from the row that is
/// already there, or locks and inspects that row. Every decision is arbitrated by PostgreSQL: the
/// unique index for a new key, the row lock for one that may need work.
pub async fn claim(
    pool: &Pool,
    policy: RetryPolicy,
    user_id: i64,
    key: &IdempotencyKey,
    request: &RequestSignature,
    lock_timeout: Duration,
) -> Result<Claimed, StoreError> {
    claim_for(
        pool,
        None,
        policy,
        Caller::Id(user_id),
        key,
        request,
        lock_timeout,
    )
    .await?
    .map(|(_, claimed)| claimed)
    .ok_or(StoreError::Database(DieselError::NotFound))
}

/// Whether `key` exists for the caller (a user id, or the owner of a token digest). A read only,
/// through the `(user_id, idempotency_key)` unique index: for refusing a card tester's new keys
/// without writing anything (`crate::limits`).
pub async fn key_exists(
    pool: &Pool,
    caller: crate::limits::Caller,
    key: &IdempotencyKey,
) -> Result<bool, StoreError> {
    #[derive(QueryableByName)]
    struct Exists {
        #[diesel(sql_type = Bool)]
        exists: bool,
    }
    let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
    let query = match caller {
        crate::limits::Caller::OnBehalfOf(user_id) => diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM idempotency_keys \
             WHERE user_id = $1 AND idempotency_key = $2) AS exists",
        )
        .into_boxed()
        .bind::<BigInt, _>(user_id)
        .bind::<Text, _>(key.as_str()),
        crate::limits::Caller::Token(digest) => diesel::sql_query(
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

/// [`claim`] for the owner of the API token whose digest is `token_digest`, authenticating in the
/// same statement: a new key, a replay or a mismatch costs one round trip in all, shared with
/// the claims `batcher` sends along. `None` if no user has this token (nothing is written then).
pub async fn authenticate_and_claim(
    pool: &Pool,
    batcher: &Arc<ClaimBatcher>,
    policy: RetryPolicy,
    token_digest: &[u8; 32],
    key: &IdempotencyKey,
    request: &RequestSignature,
    lock_timeout: Duration,
) -> Result<Option<(User, Claimed)>, StoreError> {
    claim_for(
        pool,
        Some(batcher),
        policy,
        Caller::Token(token_digest),
        key,
        request,
        lock_timeout,
    )
    .await
}

#[tracing::instrument(
    name = "claim",
    skip_all,
    fields(otel.name = "claim idempotency key", db.system.name = "postgresql", rides.claim = tracing::field::Empty)
)]
async fn claim_for(
    pool: &Pool,
    batcher: Option<&Arc<ClaimBatcher>>,
    policy: RetryPolicy,
    caller: Caller<'_>,
    key: &IdempotencyKey,
    request: &RequestSignature,
    lock_timeout: Duration,
) -> Result<Option<(User, Claimed)>, StoreError> {
    let found = match (caller, batcher) {
        (Caller::Token(digest), Some(batcher)) => batcher.claim(digest, key, request).await?,
        _ => claim_alone(pool, policy, caller, key, request).await?,
    };
    let (user, decided) = match found {
        Some((user, found)) => {
            let decided = decide(
                pool,
                policy,
                user.id,
                key,
                request,
                chrono_duration(lock_timeout),
                found,
            )
            .await?;
            (user, decided)
        }
        // No such user, or a claim of this key that committed after the statement's snapshot
        // (rare): tell them apart with a plain read.
        None => {
            let user = match caller {
                Caller::Id(user_id) => crate::auth::user_by_id(pool, user_id).await?,
                Caller::Token(digest) => crate::auth::user_by_token_digest(pool, digest).await?,
            };
            let Some(user) = user else { return Ok(None) };
            (user, None)
        }
    };
    let claimed = match decided {
        Some(claimed) => claimed,
        None => claim_rounds(pool, policy, user.id, key, request, lock_timeout).await?,
    };
    tracing::Span::current().record("rides.claim", claimed.decision());
    Ok(Some((user, claimed)))
}

async fn claim_rounds(
    pool: &Pool,
    policy: RetryPolicy,
    user_id: i64,
    key: &IdempotencyKey,
    request: &RequestSignature,
    lock_timeout: Duration,
) -> Result<Claimed, StoreError> {
    let lock_timeout = chrono_duration(lock_timeout);
    // Each round pays only for what the key needs: a new key, a replay and a mismatch are one
    // statement (`insert_or_read`); only a key that may need work takes the row lock. A round ends
    // without a decision only if another claim inserted the key after this one's snapshot, or the
    // key was reaped between two steps, so a few rounds suffice.
    for _ in 0..CLAIM_ROUNDS {
        let found = claim_alone(pool, policy, Caller::Id(user_id), key, request).await?;
        let Some((_, found)) = found else { continue };
        if let Some(claimed) =
            decide(pool, policy, user_id, key, request, lock_timeout, found).await?
        {
            return Ok(claimed);
        }
    }
    Err(StoreError::KeyVanished)
}

/// A configured duration (the lock timeout, the key TTL) as timestamp arithmetic wants it; one
/// too long for chrono saturates rather than fails.
pub fn chrono_duration(duration: Duration) -> chrono::Duration {
    chrono::Duration::from_std(duration).unwrap_or(chrono::Duration::MAX)
}

/// Whether a key locked at `locked_at` is still held at `now`: a lock older than the lock timeout
/// may be taken over (its holder is presumed dead). The one statement of the rule, for the claim
/// here and for `workers admin`.
pub fn lock_is_live(
    locked_at: chrono::DateTime<chrono::Utc>,
    now: chrono::DateTime<chrono::Utc>,
    lock_timeout: chrono::Duration,
) -> bool {
    locked_at > now - lock_timeout
}

/// What a claim's statement found, decided: at once for a new key, a replay or a mismatch, under
/// the row lock otherwise. `None` if the key was reaped meanwhile.
async fn decide(
    pool: &Pool,
    policy: RetryPolicy,
    user_id: i64,
    key: &IdempotencyKey,
    request: &RequestSignature,
    lock_timeout: chrono::Duration,
    found: Found,
) -> Result<Option<Claimed>, StoreError> {
    match found {
        Found::Inserted(claimed) => Ok(Some(claimed)),
        Found::Existing(row) => match decide_without_lock(*row, request)? {
            Some(claimed) => Ok(Some(claimed)),
            None => {
                retry_transient(policy, || async {
                    let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
                    conn.build_transaction()
                        .read_committed()
                        .run(async |conn| {
                            lock_existing(conn, user_id, key, request, lock_timeout).await
                        })
                        .await
                })
                .await
            }
        },
    }
}

/// How many insert/inspect rounds a claim makes before giving up on a key that keeps vanishing.
const CLAIM_ROUNDS: usize = 5;

/// Every column of `idempotency_keys` that [`KeyRow`] reads, by name, each with the same prefix
/// (a table alias and its dot) if one is given.
macro_rules! key_columns {
    () => {
        key_columns!("")
    };
    ($p:literal) => {
        concat!(
            $p,
            "id, ",
            $p,
            "created_at, ",
            $p,
            "idempotency_key, ",
            $p,
            "last_run_at, ",
            $p,
            "locked_at, ",
            $p,
            "lock_token, ",
            $p,
            "request_method, ",
            $p,
            "request_path, ",
            $p,
            "request_params, ",
            $p,
            "response_code, ",
            $p,
            "response_body, ",
            $p,
            "recovery_point, ",
            $p,
            "user_id"
        )
    };
}

// After `key_columns!`, which the claim batch statement uses.
mod claims;

/// The claim's one statement, for the user `caller` selects (`$1`). The key row if it exists (a
/// replay, a mismatch or a resumption is decided from it without a lock); otherwise the key
/// inserted, locked by a fresh token. `ON CONFLICT DO NOTHING` waits for a concurrent inserter of
/// the same key and then yields to it; that key is newer than this statement's snapshot, so no
/// row comes back and the claim looks again. A key that exists inserts nothing, so a replay
/// writes nothing and burns no sequence value; no user, no row and nothing written.
macro_rules! claim_sql {
    ($caller:literal) => {
        concat!(
            "WITH caller AS (SELECT id, created_at, email, stripe_customer_id, \
             stripe_payment_method_id, api_token_digest FROM users WHERE ",
            $caller,
            "), existing AS (SELECT ",
            key_columns!(),
            " FROM idempotency_keys WHERE user_id = (SELECT id FROM caller) \
             AND idempotency_key = $2), \
             inserted AS (INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, \
             request_method, request_path, request_params, recovery_point, locked_at) \
             SELECT caller.id, $2, $3, $4, $5, $6, 'started', now() FROM caller \
             WHERE NOT EXISTS (SELECT FROM existing) \
             ON CONFLICT (user_id, idempotency_key) DO NOTHING RETURNING ",
            key_columns!(),
            "), found AS (SELECT ",
            key_columns!(),
            ", true AS inserted FROM inserted UNION ALL SELECT ",
            key_columns!(),
            ", false FROM existing) \
             SELECT caller.id AS caller_id, caller.created_at AS caller_created_at, caller.email, \
             caller.stripe_customer_id, caller.stripe_payment_method_id, caller.api_token_digest, \
             found.* FROM caller, found"
        )
    };
}

/// The claim of a user known by id.
struct ClaimById;

impl Statement for ClaimById {
    const SQL: &'static str = claim_sql!("id = $1");
}

/// The claim of the owner of an API token, by its digest: authentication in the same round trip.
struct ClaimByToken;

impl Statement for ClaimByToken {
    const SQL: &'static str = claim_sql!("api_token_digest = $1");
}

#[derive(Clone, Copy)]
enum Caller<'a> {
    Id(i64),
    Token(&'a [u8; 32]),
}

/// What a claim statement returns: the caller and the key row. Public only as the output of
/// [`ClaimBatch`]; its fields stay private.
#[derive(QueryableByName)]
pub struct ClaimRow {
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
    key: KeyRow,
    #[diesel(sql_type = Bool)]
    inserted: bool,
}

enum Found {
    Inserted(Claimed),
    Existing(Box<KeyRow>),
}

/// The claim's statement for one claim, on a pooled connection, retried on transient conflicts.
async fn claim_alone(
    pool: &Pool,
    policy: RetryPolicy,
    caller: Caller<'_>,
    key: &IdempotencyKey,
    request: &RequestSignature,
) -> Result<Option<(User, Found)>, StoreError> {
    retry_transient(policy, || async {
        let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
        insert_or_read(&mut conn, caller, key, request).await
    })
    .await
}

/// Runs the claim's statement; `None` if there is no such user, or if a concurrent claim inserted
/// the key meanwhile.
async fn insert_or_read(
    conn: &mut AsyncPgConnection,
    caller: Caller<'_>,
    key: &IdempotencyKey,
    request: &RequestSignature,
) -> Result<Option<(User, Found)>, StoreError> {
    let token = Uuid::new_v4();
    macro_rules! run {
        ($statement:ty, $caller_type:ty, $caller:expr) => {
            prepared::<$statement, _>(|q| {
                q.bind::<$caller_type, _>($caller)
                    .bind::<Text, _>(key.as_str())
                    .bind::<sql_types::Uuid, _>(token)
                    .bind::<Text, _>(request.method)
                    .bind::<Text, _>(request.path)
                    .bind::<Jsonb, _>(&request.params)
            })
            .get_result::<ClaimRow>(conn)
            .await
            .optional()?
        };
    }
    let row = match caller {
        Caller::Id(user_id) => run!(ClaimById, BigInt, user_id),
        Caller::Token(digest) => run!(ClaimByToken, Bytea, digest.as_slice()),
    };
    Ok(row.map(|row| row.into_found(token)))
}

impl ClaimRow {
    /// The caller and what the claim found; `token` is the lock token the statement was given,
    /// which an inserted key now carries.
    fn into_found(self, token: Uuid) -> (User, Found) {
        let user = User {
            id: self.caller_id,
            created_at: self.caller_created_at,
            email: self.email,
            stripe_customer_id: self.stripe_customer_id,
            stripe_payment_method_id: self.stripe_payment_method_id,
            api_token_digest: self.api_token_digest,
        };
        let found = if self.inserted {
            Found::Inserted(Claimed {
                claim: Claim::Execute(Lease {
                    key_id: self.key.id,
                    user_id: user.id,
                    token,
                    recovery_point: RecoveryPoint::Started,
                }),
                key_created_at: self.key.created_at,
            })
        } else {
            Found::Existing(Box::new(self.key))
        };
        (user, found)
    }
}

/// The read-only decisions of a claim. A finished key never changes again, and neither do the
/// parameters a key is bound to, so a replay or a mismatch can be decided from a plain read: no
/// row lock, no transaction id, no WAL flush. `None` for a key that may need work, which goes
/// through the locking claim.
fn decide_without_lock(
    row: KeyRow,
    request: &RequestSignature,
) -> Result<Option<Claimed>, StoreError> {
    let claim = if !binds(&row, request) {
        Claim::Mismatch
    } else if row.recovery_point == RecoveryPoint::Finished {
        Claim::Replay(stored_response(row.response_code, row.response_body)?)
    } else {
        return Ok(None);
    };
    Ok(Some(Claimed {
        claim,
        key_created_at: row.created_at,
    }))
}

/// The outcome stored on a finished key (the schema guarantees both parts are present).
fn stored_response(
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

impl Claimed {
    fn decision(&self) -> &'static str {
        match &self.claim {
            Claim::Mismatch => "mismatch",
            Claim::Replay(_) => "replay",
            Claim::InUse => "in_use",
            Claim::Execute(_) => "execute",
        }
    }
}

/// The locking inspection of an existing key, in one READ COMMITTED transaction: the
/// `SELECT … FOR UPDATE` serialises it with every other attempt on the key. `None` if the key was
/// deleted (reaped) since it was seen.
async fn lock_existing(
    conn: &mut AsyncPgConnection,
    user_id: i64,
    key: &IdempotencyKey,
    request: &RequestSignature,
    lock_timeout: chrono::Duration,
) -> Result<Option<Claimed>, StoreError> {
    let token = Uuid::new_v4();
    let existing = idempotency_keys::table
        .filter(idempotency_keys::user_id.eq(user_id))
        .filter(idempotency_keys::idempotency_key.eq(key.as_str()))
        .for_update()
        .select((
            KeyRow::as_select(),
            diesel::dsl::sql::<diesel::sql_types::Timestamptz>("now()"),
        ))
        .first::<(KeyRow, DateTime<Utc>)>(conn)
        .await
        .optional()?;
    let Some((row, now)) = existing else {
        return Ok(None);
    };
    let claim = if !binds(&row, request) {
        Claim::Mismatch
    } else if row.recovery_point == RecoveryPoint::Finished {
        Claim::Replay(stored_response(row.response_code, row.response_body)?)
    } else if row
        .locked_at
        .is_some_and(|locked_at| lock_is_live(locked_at, now, lock_timeout))
    {
        Claim::InUse
    } else {
        diesel::update(idempotency_keys::table.find(row.id))
            .set((
                idempotency_keys::locked_at.eq(diesel::dsl::now),
                idempotency_keys::lock_token.eq(token),
                idempotency_keys::last_run_at.eq(diesel::dsl::now),
            ))
            .execute(conn)
            .await?;
        Claim::Execute(Lease {
            key_id: row.id,
            user_id,
            token,
            recovery_point: row.recovery_point,
        })
    };
    Ok(Some(Claimed {
        claim,
        key_created_at: row.created_at,
    }))
}

/// The fence every phase statement starts with, as a CTE named `fence` (binds: `$1` the key id,
/// `$2` the lease's token). It locks the key row and yields it only while the token is this
/// lease's; each of the phase's writes selects from it (directly or through a write that does),
/// so a lease that was taken over writes nothing and its statement returns no row. The row lock
/// is taken before any write, and held until the statement's implicit transaction commits, so
/// two attempts on one key still run their phases one after the other. A concurrent takeover
/// makes the lock wait for it and then re-check the token on the newest row version (READ
/// COMMITTED's re-check of locked rows), so it is never missed.
macro_rules! fence {
    () => {
        "fence AS (SELECT id FROM idempotency_keys WHERE id = $1 AND lock_token = $2 \
         FOR NO KEY UPDATE)"
    };
}
pub(crate) use fence;

/// The `SET` list that finishes a key: the outcome (`$code`, `$body` binds), the final recovery
/// point, and the lock cleared.
macro_rules! finish_key {
    ($code:literal, $body:literal) => {
        concat!(
            "UPDATE idempotency_keys SET recovery_point = 'finished', response_code = ",
            $code,
            ", response_body = ",
            $body,
            ", locked_at = NULL, lock_token = NULL"
        )
    };
}
pub(crate) use finish_key;

/// What a phase statement returns when it committed: the key it moved on.
#[derive(QueryableByName)]
pub struct KeyMoved {
    #[diesel(sql_type = BigInt)]
    pub id: i64,
}

/// Runs one atomic phase: `statement` is ONE SQL statement, run outside any explicit transaction
/// (so in its own implicit READ COMMITTED transaction, which commits the phase's writes and its
/// recovery point together), that starts with [`fence`] and returns a row only if the fence
/// passed. No row means this lease no longer owns the key: [`StoreError::LockLost`], and nothing
/// was written. Transient conflicts re-run the statement; a failed run was rolled back whole.
///
/// One statement is one round trip: the key row's lock is held only while PostgreSQL executes it,
/// never while this process waits for a CPU between statements.
pub async fn atomic_phase<'a, T, F>(
    pool: &Pool,
    policy: RetryPolicy,
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
        crate::fault::crash_point(crash_point_name(lease.recovery_point, false));
        let done = statement(&mut conn)
            .await
            .map_err(|error| lost_connection_discarded(&mut conn, error))?
            .ok_or(StoreError::LockLost)?;
        crate::fault::crash_point(crash_point_name(lease.recovery_point, true));
        Ok(done)
    })
    .await
}

/// An atomic phase sent through `batcher` together with other requests' same phase, or `alone`
/// (an [`atomic_phase`]) when batching is off or the batch could not decide it. The batch
/// statement fences every request as [`fence`] does; `None` for a request means its fence failed
/// and nothing of it was written. The crash points fire as around [`atomic_phase`]'s statement.
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
        crate::fault::crash_point(crash_point_name(lease.recovery_point, false));
        if let Some(decided) = batcher.submit(item()).await? {
            let done = decided.ok_or(StoreError::LockLost)?;
            crate::fault::crash_point(crash_point_name(lease.recovery_point, true));
            return Ok(done);
        }
    }
    alone().await
}

/// The crash points around the commit of the phase that starts at `point`.
fn crash_point_name(point: RecoveryPoint, committed: bool) -> &'static str {
    match (point, committed) {
        (RecoveryPoint::Started, false) => "started.before_commit",
        (RecoveryPoint::Started, true) => "started.after_commit",
        (RecoveryPoint::RideCreated, false) => "ride_created.before_commit",
        (RecoveryPoint::RideCreated, true) => "ride_created.after_commit",
        (RecoveryPoint::ChargeCreated, false) => "charge_created.before_commit",
        (RecoveryPoint::ChargeCreated, true) => "charge_created.after_commit",
        (RecoveryPoint::Finished, _) => "finished",
    }
}

/// Finishes the key with `response` and nothing else (a final outcome reached without further
/// writes, such as a declined card), as the atomic phase of `lease.recovery_point`.
struct FinishKey;

impl Statement for FinishKey {
    const SQL: &'static str = concat!(
        "WITH ",
        fence!(),
        " ",
        finish_key!("$3", "$4"),
        " FROM fence WHERE idempotency_keys.id = fence.id AND idempotency_keys.lock_token = $2 \
         RETURNING idempotency_keys.id"
    );
}

/// Stores the final outcome, marks the key finished and unlocks it, in one fenced statement.
pub async fn finish(
    pool: &Pool,
    policy: RetryPolicy,
    lease: &Lease,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    atomic_phase(pool, policy, lease, |conn| {
        prepared::<FinishKey, _>(|q| {
            q.bind::<BigInt, _>(lease.key_id)
                .bind::<sql_types::Uuid, _>(lease.token)
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

/// Unlocks a key this attempt still owns so that a retry may continue at once, without waiting
/// for the lock to expire. Releasing a lease that was taken over changes nothing.
pub async fn release(pool: &Pool, policy: RetryPolicy, lease: &Lease) -> Result<bool, StoreError> {
    retry_transient(policy, || async {
        let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
        let updated = diesel::update(idempotency_keys::table)
            .filter(idempotency_keys::id.eq(lease.key_id))
            .filter(idempotency_keys::lock_token.eq(lease.token))
            .set((
                idempotency_keys::locked_at.eq(None::<DateTime<Utc>>),
                idempotency_keys::lock_token.eq(None::<Uuid>),
            ))
            .execute(&mut conn)
            .await?;
        Ok(updated == 1)
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn database_error(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn a_lost_connection_is_unavailability_not_an_internal_error() {
        for lost in [
            database_error(DatabaseErrorKind::ClosedConnection, "connection closed"),
            database_error(
                DatabaseErrorKind::Unknown,
                "terminating connection due to administrator command",
            ),
            database_error(
                DatabaseErrorKind::Unknown,
                "the database system is shutting down",
            ),
        ] {
            assert!(matches!(
                StoreError::from(lost),
                StoreError::ConnectionLost(_)
            ));
        }
        let constraint = database_error(DatabaseErrorKind::UniqueViolation, "duplicate key");
        assert!(matches!(
            StoreError::from(constraint),
            StoreError::Database(_)
        ));
    }

    #[test]
    fn recognises_serialization_failures_and_deadlocks_only() {
        assert!(is_transient(&database_error(
            DatabaseErrorKind::SerializationFailure,
            "could not serialize access"
        )));
        assert!(is_transient(&database_error(
            DatabaseErrorKind::Unknown,
            "deadlock detected"
        )));
        assert!(!is_transient(&database_error(
            DatabaseErrorKind::UniqueViolation,
            "duplicate key"
        )));
        assert!(!is_transient(&DieselError::NotFound));
    }

    #[tokio::test]
    async fn gives_up_after_the_bounded_number_of_attempts() {
        let attempts = AtomicU32::new(0);
        let policy = RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(1),
        };
        let result: Result<(), _> = retry_transient(policy, || async {
            attempts.fetch_add(1, Ordering::SeqCst);
            Err(StoreError::Database(database_error(
                DatabaseErrorKind::SerializationFailure,
                "could not serialize access",
            )))
        })
        .await;
        assert!(matches!(
            result,
            Err(StoreError::Contended { attempts: 3, .. })
        ));
        assert_eq!(AtomicU32::load(&attempts, Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn does_not_retry_other_errors() {
        let attempts = AtomicU32::new(0);
        let result: Result<(), _> = retry_transient(RetryPolicy::default(), || async {
            attempts.fetch_add(1, Ordering::SeqCst);
            Err(StoreError::LockLost)
        })
        .await;
        assert!(matches!(result, Err(StoreError::LockLost)));
        assert_eq!(AtomicU32::load(&attempts, Ordering::SeqCst), 1);
    }
}
