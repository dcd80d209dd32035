//! Claims by API token, several per statement.
//!
//! A user's claim is one statement, and for a replay that statement is nearly all the work the
//! database does for the request. PostgreSQL pays a fixed price per statement (protocol
//! messages, executor start-up, locking the relations a data-modifying CTE touches) that is
//! several times the price of one more row, so concurrent claims are sent together: on this
//! project's 2-core machine eight claims in one statement cost the database about a quarter of
//! what eight statements cost (`docs/performance.md`, run 6). A batch is also one commit, so new
//! keys claimed together share one WAL flush.
//!
//! Batching never adds a wait: a claim that finds fewer than `in_flight` batches running starts
//! one at once, alone if need be. Claims queue only while that many batches are already running,
//! and the next batch takes everything queued by then. Whatever a batch cannot decide for a claim
//! (any error but an exhausted pool, or a panic) the claim retries alone with the one-claim
//! statement, so a batch never turns one request's problem into another's error.
//!
//! What each claim decides is what the one-claim statement decides, row for row: the same
//! snapshot rules, the same `ON CONFLICT DO NOTHING` arbitration by the unique index. Two claims
//! of the same key in one batch cannot both win: the key's row is inserted once, and only the
//! claim whose lock token it carries gets it back; the other claim finds no row and looks again,
//! as it would after losing to a concurrent statement. Keys are inserted in (user, key) order so
//! that two batches that share keys wait for each other in one order and cannot deadlock.

use std::{
    collections::HashMap,
    mem,
    panic::AssertUnwindSafe,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use diesel::{
    QueryableByName,
    sql_types::{Array, Bytea, Jsonb, Text},
};
use diesel_async::RunQueryDsl;
use futures_util::FutureExt;
use schema::{
    Pool,
    models::User,
    prepared::{Statement, prepared},
};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::{
    Caller, ClaimRow, Found, IdempotencyKey, RequestSignature, RetryPolicy, StoreError,
    claim_alone, retry_transient,
};

/// How claims by token are grouped into statements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimBatching {
    /// The most claims one statement carries; 1 sends every claim alone.
    pub max_size: usize,
    /// How many batch statements may run at once; claims beyond them wait for the next batch.
    pub in_flight: usize,
}

impl Default for ClaimBatching {
    /// Two batches in flight rather than four: at 32 clients replaying, larger batches cost
    /// PostgreSQL 0.61 instead of 0.73 cores and served 8 % more replays (11,349–11,808/s
    /// against 9,986–10,988/s), with no change for new keys or at 500 clients
    /// (`docs/performance.md`, session 4).
    fn default() -> Self {
        ClaimBatching {
            max_size: 32,
            in_flight: 2,
        }
    }
}

/// Sends concurrent claims by token to PostgreSQL together. Cheap to share: one per process.
pub struct ClaimBatcher {
    pool: Pool,
    policy: RetryPolicy,
    batching: ClaimBatching,
    queue: Mutex<Queue>,
    statements: AtomicU64,
    claims: AtomicU64,
}

/// How many batch statements ran to completion and how many claims they decided, since start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchCounts {
    pub statements: u64,
    pub claims: u64,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<PendingClaim>,
    running: usize,
}

/// One claim waiting for its batch.
struct PendingClaim {
    token_digest: [u8; 32],
    key: String,
    /// The lock token the key gets if this claim inserts it.
    lock_token: Uuid,
    request: RequestSignature,
    verdict: oneshot::Sender<Verdict>,
}

/// What a batch says about one of its claims. A claim whose sender is dropped (the batch failed
/// or panicked) has no verdict and claims alone.
enum Verdict {
    /// The statement ran: the claim's row, or `None` for an unknown token or a key that a
    /// concurrent claim inserted first.
    Decided(Option<Box<ClaimRow>>),
    /// No connection came free within the pool's timeout; another try would wait as long again.
    PoolTimedOut,
}

impl ClaimBatcher {
    pub fn new(pool: Pool, policy: RetryPolicy, batching: ClaimBatching) -> Arc<ClaimBatcher> {
        Arc::new(ClaimBatcher {
            pool,
            policy,
            batching: ClaimBatching {
                max_size: batching.max_size.max(1),
                in_flight: batching.in_flight.max(1),
            },
            queue: Mutex::new(Queue::default()),
            statements: AtomicU64::new(0),
            claims: AtomicU64::new(0),
        })
    }

    /// What batching has done so far: claims per statement is the saving it brings.
    pub fn counts(&self) -> BatchCounts {
        BatchCounts {
            statements: AtomicU64::load(&self.statements, Ordering::Relaxed),
            claims: AtomicU64::load(&self.claims, Ordering::Relaxed),
        }
    }

    /// The claim statement's result for the owner of `token_digest`: the user and what was
    /// found, or `None` as [`super::insert_or_read`] returns it.
    pub(super) async fn claim(
        self: &Arc<Self>,
        token_digest: &[u8; 32],
        key: &IdempotencyKey,
        request: &RequestSignature,
    ) -> Result<Option<(User, Found)>, StoreError> {
        if self.batching.max_size > 1 {
            let lock_token = Uuid::new_v4();
            let (sender, verdict) = oneshot::channel();
            self.submit(PendingClaim {
                token_digest: *token_digest,
                key: key.as_str().to_owned(),
                lock_token,
                request: request.clone(),
                verdict: sender,
            });
            match verdict.await {
                Ok(Verdict::Decided(row)) => {
                    return Ok(row.map(|row| row.into_found(lock_token)));
                }
                Ok(Verdict::PoolTimedOut) => {
                    return Err(StoreError::Unavailable(bb8::RunError::TimedOut));
                }
                // The batch failed; this claim's own statement will say how.
                Err(oneshot::error::RecvError { .. }) => {}
            }
        }
        claim_alone(
            &self.pool,
            self.policy,
            Caller::Token(token_digest),
            key,
            request,
        )
        .await
    }

    /// Queues `claim`, and starts a batch if fewer than `in_flight` are running.
    fn submit(self: &Arc<Self>, claim: PendingClaim) {
        let batch = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.waiting.push(claim);
            if queue.running >= self.batching.in_flight {
                return;
            }
            queue.running += 1;
            self.take_batch(&mut queue)
        };
        tokio::spawn(Arc::clone(self).run(batch));
    }

    fn take_batch(&self, queue: &mut Queue) -> Vec<PendingClaim> {
        if queue.waiting.len() <= self.batching.max_size {
            mem::take(&mut queue.waiting)
        } else {
            queue.waiting.drain(..self.batching.max_size).collect()
        }
    }

    /// Runs batches until the queue is empty. Only a runner that saw the queue empty under the
    /// lock stops, so a queued claim always has a runner that will take it.
    async fn run(self: Arc<Self>, mut batch: Vec<PendingClaim>) {
        loop {
            // A panic drops the batch's senders: its claims then claim alone.
            let _ = AssertUnwindSafe(self.decide_batch(batch))
                .catch_unwind()
                .await;
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            if queue.waiting.is_empty() {
                queue.running -= 1;
                return;
            }
            batch = self.take_batch(&mut queue);
        }
    }

    async fn decide_batch(&self, batch: Vec<PendingClaim>) {
        let digests: Vec<&[u8]> = batch.iter().map(|c| c.token_digest.as_slice()).collect();
        let keys: Vec<&str> = batch.iter().map(|c| c.key.as_str()).collect();
        let lock_tokens: Vec<Uuid> = batch.iter().map(|c| c.lock_token).collect();
        let methods: Vec<&str> = batch.iter().map(|c| c.request.method).collect();
        let paths: Vec<&str> = batch.iter().map(|c| c.request.path).collect();
        let params: Vec<&serde_json::Value> = batch.iter().map(|c| &c.request.params).collect();
        let rows = retry_transient(self.policy, || async {
            let mut conn = self.pool.get().await.map_err(StoreError::Unavailable)?;
            prepared::<ClaimBatchByToken, _>(|q| {
                q.bind::<Array<Bytea>, _>(&digests)
                    .bind::<Array<Text>, _>(&keys)
                    .bind::<Array<diesel::sql_types::Uuid>, _>(&lock_tokens)
                    .bind::<Array<Text>, _>(&methods)
                    .bind::<Array<Text>, _>(&paths)
                    .bind::<Array<Jsonb>, _>(&params)
            })
            .load::<BatchRow>(&mut conn)
            .await
            .map_err(StoreError::from)
        })
        .await;
        match rows {
            Ok(rows) => {
                let claims = batch.len() as u64;
                self.statements.fetch_add(1, Ordering::Relaxed);
                self.claims.fetch_add(claims, Ordering::Relaxed);
                crate::metrics::metrics()
                    .claim_batch_size
                    .record(claims, &[]);
                let mut rows: HashMap<Uuid, Box<ClaimRow>> = rows
                    .into_iter()
                    .map(|row| (row.req, Box::new(row.claim)))
                    .collect();
                for claim in batch {
                    let row = rows.remove(&claim.lock_token);
                    // A receiver that is gone no longer needs its verdict.
                    let _ = claim.verdict.send(Verdict::Decided(row));
                }
            }
            Err(StoreError::Unavailable(bb8::RunError::TimedOut)) => {
                for claim in batch {
                    let _ = claim.verdict.send(Verdict::PoolTimedOut);
                }
            }
            Err(error) => {
                tracing::debug!(
                    error = &error as &dyn std::error::Error,
                    claims = batch.len(),
                    "a claim batch failed; its claims run alone"
                );
            }
        }
    }
}

#[derive(QueryableByName)]
struct BatchRow {
    /// The lock token of the claim this row answers.
    #[diesel(sql_type = diesel::sql_types::Uuid)]
    req: Uuid,
    #[diesel(embed)]
    claim: ClaimRow,
}

/// The claim statement ([`super::ClaimByToken`]) for arrays of claims, one element each: token
/// digest, key, lock token, method, path, parameters. A claim is identified by its lock token
/// (`req`), which is fresh per claim. Rows come back only for claims whose token matched a user,
/// and for a new key only to the claim whose lock token the inserted row carries. The lookups
/// are `LATERAL … LIMIT 1` so that the plan, which is generic once prepared and cannot know how
/// many claims a batch holds, stays one index probe per claim instead of hashing whole tables.
struct ClaimBatchByToken;

impl Statement for ClaimBatchByToken {
    const SQL: &'static str = concat!(
        "WITH input AS (SELECT * FROM unnest($1::bytea[], $2::text[], $3::uuid[], $4::text[], \
         $5::text[], $6::jsonb[]) AS i(digest, key, token, method, path, params)), \
         caller AS (SELECT input.token AS req, input.key AS req_key, u.* FROM input \
         CROSS JOIN LATERAL (SELECT id, created_at, email, stripe_customer_id, \
         stripe_payment_method_id, api_token_digest FROM users \
         WHERE users.api_token_digest = input.digest LIMIT 1) u), \
         existing AS (SELECT caller.req AS found_req, k.* FROM caller \
         CROSS JOIN LATERAL (SELECT ",
        key_columns!(),
        " FROM idempotency_keys WHERE user_id = caller.id \
         AND idempotency_key = caller.req_key LIMIT 1) k), \
         inserted AS (INSERT INTO idempotency_keys (user_id, idempotency_key, lock_token, \
         request_method, request_path, request_params, recovery_point, locked_at) \
         SELECT caller.id, input.key, input.token, input.method, input.path, input.params, \
         'started', now() FROM caller JOIN input ON input.token = caller.req \
         WHERE NOT EXISTS (SELECT FROM existing WHERE existing.found_req = caller.req) \
         ORDER BY caller.id, input.key \
         ON CONFLICT (user_id, idempotency_key) DO NOTHING RETURNING ",
        key_columns!(""),
        "), found AS (SELECT lock_token AS found_req, ",
        key_columns!(""),
        ", true AS inserted FROM inserted UNION ALL SELECT found_req, ",
        key_columns!(""),
        ", false FROM existing) \
         SELECT caller.req, caller.id AS caller_id, caller.created_at AS caller_created_at, \
         caller.email, caller.stripe_customer_id, caller.stripe_payment_method_id, \
         caller.api_token_digest, found.* FROM caller JOIN found ON found.found_req = caller.req"
    );
}
