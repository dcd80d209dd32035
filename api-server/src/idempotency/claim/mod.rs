//! Claiming a key: the first step of every request. A claim inserts the key, or decides a
//! replay or a mismatch from the row that is already there, or locks and inspects that row. Every
//! decision is arbitrated by PostgreSQL: the unique index for a new key, the row lock for one that
//! may need work. The claim authenticates its caller in the same statement (the `users` row by
//! token digest or by id), so a new key, a replay or a mismatch costs one round trip; claims by
//! token are sent together with other callers' claims ([`batched`]). A claim that inserts a key
//! inserts the request's first phase with it in the same statement ([`first_ride`]).

mod batched;
mod first_ride;
mod statements;

use std::sync::Arc;

use chrono::{DateTime, Utc};
use contract::{
    StoredResponse,
    key::{LockRule, LockState, lock_state_of_key},
};
use diesel::{
    ExpressionMethods, OptionalExtension, QueryDsl, QueryableByName, SelectableHelper,
    sql_types::{self, BigInt, Bool, Bytea, Cidr, Double, Jsonb, Nullable, Text, Timestamptz},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{
    Pool, RecoveryPoint,
    models::{IdempotencyKeyRow as KeyRow, Ride, User},
    prepared::prepared,
    schema::idempotency_keys,
    store::{ConflictRetry, StoreError, retry_transient},
};
use uuid::Uuid;

pub use batched::Claims;
pub use first_ride::FirstRide;

use first_ride::first_ride_writes;
use statements::{ClaimById, ClaimByToken, key_columns};

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
pub struct Claimed {
    pub decision: Decision,
    pub key_created_at: DateTime<Utc>,
    /// The ride this claim inserted with the key ([`FirstRide`]): the key is at `ride_created`.
    /// `None` for every other claim.
    pub first_ride: Option<Ride>,
}

/// Claims `key` for `caller`: authenticates the caller and decides the key in the claim's
/// statement, sent with other callers' claims through `claims` (for a token; a claim on a user's
/// behalf goes alone). `None` if the caller is no user (nothing is written then). If the claim
/// inserts the key, it inserts `first_ride` with it ([`FirstRide`]). Every lock the claim takes
/// names this process's liveness session as its holder (`liveness`), and a key locked by another
/// attempt is taken over as `rule` says.
#[tracing::instrument(
    name = "claim",
    skip_all,
    fields(
        otel.name = "claim idempotency key",
        db.system.name = "postgresql",
        rides.claim = tracing::field::Empty,
        rides.recovery_point.to = tracing::field::Empty,
    )
)]
pub async fn claim(
    claims: &Arc<Batcher<Claims>>,
    caller: Caller,
    key: &IdempotencyKey,
    request: &RequestSignature,
    first_ride: &FirstRide,
    locking: &Locking,
    token: Uuid,
) -> Result<Option<(User, Claimed)>, StoreError> {
    let (pool, policy) = (claims.pool(), claims.policy());
    let lock = LockedBy {
        token,
        holder: locking.liveness.holder_for_lock().await,
    };
    count_statement("insert_or_read");
    let found = match caller {
        Caller::Token(digest) => {
            claims
                .claim(&digest, key, request, first_ride, lock)
                .await?
        }
        Caller::OnBehalfOf(_) => {
            claim_alone(pool, policy, caller, key, request, first_ride, lock).await?
        }
    };
    let context = ClaimContext {
        caller,
        pool,
        policy,
        key,
        request,
        first_ride,
        rule: locking.rule,
        lock,
    };
    let (user, decided) = match found {
        Some((user, found)) => {
            let decided = context.decide(user.id, found).await?;
            (user, decided)
        }
        // No such user, or a claim of this key that committed after the statement's snapshot
        // (rare): tell them apart with a plain read.
        None => {
            let user = match caller {
                Caller::OnBehalfOf(user_id) => crate::auth::user_by_id(pool, user_id).await?,
                Caller::Token(digest) => crate::auth::user_by_token_digest(pool, &digest).await?,
            };
            let Some(user) = user else { return Ok(None) };
            (user, None)
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

/// One claim's key and request, for the steps after its first statement.
struct ClaimContext<'a> {
    caller: Caller,
    pool: &'a Pool,
    policy: ConflictRetry,
    key: &'a IdempotencyKey,
    request: &'a RequestSignature,
    first_ride: &'a FirstRide,
    rule: LockRule,
    /// The lock of every statement of this claim: one that finds the key locked by its token
    /// finds its own earlier statement's lock, committed though its answer was lost.
    lock: LockedBy,
}

impl ClaimContext<'_> {
    /// Claims the key again, alone, until a round decides it.
    async fn rounds(&self, user_id: i64) -> Result<Claimed, StoreError> {
        // Each round pays only for what the key needs: a new key, a replay and a mismatch are one
        // statement (`insert_or_read`); only a key that may need work takes the row lock. A round
        // ends without a decision only if another claim inserted the key after this one's
        // snapshot, or the key was reaped between two steps, so a few rounds suffice. The
        // caller's own statement: only a token's claim may insert the key again.
        let caller = self.caller;
        for _ in 0..CLAIM_ROUNDS {
            count_statement("insert_or_read");
            let found = claim_alone(
                self.pool,
                self.policy,
                caller,
                self.key,
                self.request,
                self.first_ride,
                self.lock,
            )
            .await?;
            let Some((_, found)) = found else { continue };
            if let Some(claimed) = self.decide(user_id, found).await? {
                return Ok(claimed);
            }
        }
        Err(StoreError::KeyVanished)
    }

    /// What a claim's statement found, decided: at once for a new key, a replay or a mismatch,
    /// under the row lock otherwise. `None` if the key was reaped meanwhile.
    async fn decide(&self, user_id: i64, found: KeyFound) -> Result<Option<Claimed>, StoreError> {
        let row = match found {
            KeyFound::Inserted(claimed) => return Ok(Some(*claimed)),
            KeyFound::Existing(row) => row,
        };
        if let Some(claimed) = decide_without_lock(*row, self.request)? {
            return Ok(Some(claimed));
        }
        retry_transient(self.policy, || async {
            let mut conn = self.pool.get().await.map_err(StoreError::Unavailable)?;
            count_statement("lock");
            conn.build_transaction()
                .read_committed()
                .run(async |conn| lock_existing(conn, user_id, self).await)
                .await
        })
        .await
    }
}

fn count_statement(step: &'static str) {
    crate::metrics::metrics()
        .claim_statements
        .add(1, &[telemetry::attr("step", step)]);
}

/// How many insert/inspect rounds a claim makes before giving up on a key that keeps vanishing.
const CLAIM_ROUNDS: usize = 5;

/// What a claim statement returns: the caller and the key row. Public only as the output of
/// [`Claims`]; its fields stay private.
#[derive(QueryableByName)]
pub struct CallerAndKey {
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
    /// The first ride inserted with the key, if any.
    #[diesel(sql_type = Nullable<BigInt>)]
    ride_id: Option<i64>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    ride_created_at: Option<DateTime<Utc>>,
}

/// What a claim's statement found: the key it inserted (so this attempt owns it), or the key
/// that was already there, to be decided.
enum KeyFound {
    Inserted(Box<Claimed>),
    Existing(Box<KeyRow>),
}

/// The claim's statement for one claim, on a pooled connection, retried on transient conflicts.
async fn claim_alone(
    pool: &Pool,
    policy: ConflictRetry,
    caller: Caller,
    key: &IdempotencyKey,
    request: &RequestSignature,
    first_ride: &FirstRide,
    lock: LockedBy,
) -> Result<Option<(User, KeyFound)>, StoreError> {
    retry_transient(policy, || async {
        let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
        insert_or_read(&mut conn, caller, key, request, first_ride, lock).await
    })
    .await
}

/// Runs the claim's statement; `None` if there is no such user, or if a concurrent claim inserted
/// the key meanwhile.
async fn insert_or_read(
    conn: &mut AsyncPgConnection,
    caller: Caller,
    key: &IdempotencyKey,
    request: &RequestSignature,
    first_ride: &FirstRide,
    lock: LockedBy,
) -> Result<Option<(User, KeyFound)>, StoreError> {
    macro_rules! run {
        ($statement:ty, $caller_type:ty, $caller:expr) => {
            prepared::<$statement, _>(|q| {
                q.bind::<$caller_type, _>($caller)
                    .bind::<Text, _>(key.as_str())
                    .bind::<sql_types::Uuid, _>(lock.token)
                    .bind::<Text, _>(request.method)
                    .bind::<Text, _>(request.path)
                    .bind::<Jsonb, _>(&request.params)
                    .bind::<Double, _>(first_ride.origin_lat)
                    .bind::<Double, _>(first_ride.origin_lon)
                    .bind::<Double, _>(first_ride.target_lat)
                    .bind::<Double, _>(first_ride.target_lon)
                    .bind::<BigInt, _>(first_ride.amount)
                    .bind::<Text, _>(first_ride.currency.as_str())
                    .bind::<Jsonb, _>(&first_ride.audit_data)
                    .bind::<Cidr, _>(first_ride.origin_ip)
                    .bind::<Text, _>(first_ride.deployment_id.as_str())
                    .bind::<Nullable<BigInt>, _>(lock.holder)
            })
            .get_result::<CallerAndKey>(conn)
            .await
            .optional()?
        };
    }
    let row = match caller {
        Caller::OnBehalfOf(user_id) => run!(ClaimById, BigInt, user_id),
        Caller::Token(digest) => run!(ClaimByToken, Bytea, digest.as_slice()),
    };
    Ok(row.map(|row| row.into_found(lock.token, first_ride)))
}

impl CallerAndKey {
    /// The caller and what the claim found; `token` is the lock token the statement was given,
    /// which an inserted key now carries, and `first_ride` the values it was given for the key's
    /// ride.
    fn into_found(self, token: Uuid, first_ride: &FirstRide) -> (User, KeyFound) {
        let user = User {
            id: self.caller_id,
            created_at: self.caller_created_at,
            email: self.email,
            stripe_customer_id: self.stripe_customer_id,
            stripe_payment_method_id: self.stripe_payment_method_id,
            api_token_digest: self.api_token_digest,
        };
        let found = if self.inserted {
            let ride = match (self.ride_id, self.ride_created_at) {
                (Some(id), Some(created_at)) => {
                    Some(first_ride.inserted(self.key.id, user.id, id, created_at))
                }
                _ => None,
            };
            KeyFound::Inserted(Box::new(Claimed {
                decision: Decision::Execute(Lease {
                    key_id: self.key.id,
                    user_id: user.id,
                    token,
                    holder: self.key.lock_holder,
                    // `ride_created`: the ride came with the key (an attempt that finds no ride
                    // here reads it back before its next phase).
                    recovery_point: self.key.recovery_point,
                }),
                key_created_at: self.key.created_at,
                first_ride: ride,
            }))
        } else {
            KeyFound::Existing(Box::new(self.key))
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
        first_ride: None,
    }))
}

/// The outcome stored on a finished key (the schema guarantees both parts are present).
pub(super) fn stored_response(
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

/// The locking inspection of an existing key, in one READ COMMITTED transaction: the
/// `SELECT … FOR UPDATE` serialises it with every other attempt on the key. `None` if the key was
/// deleted (reaped) since it was seen. A key locked by this claim's own token is this claim's:
/// an earlier statement of it committed and its answer was lost (a failover), and no other
/// attempt has taken it over since, or the token would have changed. Another attempt's lock is
/// taken over when the lock rule says it is not live, and counted by why.
async fn lock_existing(
    conn: &mut AsyncPgConnection,
    user_id: i64,
    claim: &ClaimContext<'_>,
) -> Result<Option<Claimed>, StoreError> {
    let (key, request, token) = (claim.key, claim.request, claim.lock.token);
    let existing = idempotency_keys::table
        .filter(idempotency_keys::user_id.eq(user_id))
        .filter(idempotency_keys::idempotency_key.eq(key.as_str()))
        .for_update()
        .select((KeyRow::as_select(), lock_state_of_key(claim.rule)))
        .first::<(KeyRow, String)>(conn)
        .await
        .optional()?;
    let Some((row, state)) = existing else {
        return Ok(None);
    };
    let state = LockState::parse(&state);
    let someone_elses = row.lock_token.is_some() && row.lock_token != Some(token);
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
                idempotency_keys::lock_token.eq(token),
                idempotency_keys::lock_holder.eq(claim.lock.holder),
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
            token,
            holder: claim.lock.holder,
            recovery_point: row.recovery_point,
        })
    };
    Ok(Some(Claimed {
        decision,
        key_created_at: row.created_at,
        first_ride: None,
    }))
}
