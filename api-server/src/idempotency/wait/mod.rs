//! Waiting for the attempt in flight on a key: a duplicate whose claim finds the key
//! locked by a live attempt waits for that attempt's answer instead of answering
//! `IDEMPOTENCY_KEY_IN_USE` at once.
//!
//! Every attempt that owns a key on this process says so here ([`Waits::hold`]) and, when it
//! ends, tells the key's waiters how: finished with this stored outcome, or let go without
//! finishing (an error that leaves the key resumable, a lock lost, a panic: the guard's drop
//! says it). A waiter on this process therefore does no database work while it waits. A waiter
//! whose holder runs on another process polls the key row instead, with back-off
//! ([`FIRST_POLL`] doubling to [`MAX_POLL_GAP`]); the waiters of one key on one process share
//! those polls (one read per gap, whoever wakes first), so a flood of duplicates of one key
//! costs one wait each, not a statement each.
//!
//! Waiters are bounded per key and per process ([`WaitConfig`]); a call beyond either bound,
//! whose wait is over (its deadline less a margin, `IDEMPOTENCY_WAIT_MAX_MS`, its own
//! `idempotency-wait`), or whose caller hung up answers as it did before waiting existed. A
//! waiter holds its CreateRide permit throughout, so it counts against its caller's concurrency.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use contract::{
    StoredResponse,
    key::{LockRule, LockState, lock_state_of_key},
};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::RunQueryDsl;
use schema::{Pool, RecoveryPoint, schema::idempotency_keys, store::StoreError};
use telemetry::attr;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{IdempotencyKey, claim::stored_response};
use crate::metrics::metrics;

/// The first poll of a key whose holder is on another process, after the wait starts.
pub const FIRST_POLL: Duration = Duration::from_millis(20);
/// The longest gap between two polls of one key by one process.
pub const MAX_POLL_GAP: Duration = Duration::from_millis(500);

/// How long and how many calls may wait (`IDEMPOTENCY_WAIT_MAX_MS`,
/// `IDEMPOTENCY_WAITERS_PER_KEY`, `IDEMPOTENCY_WAITERS_MAX`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WaitConfig {
    /// The longest a call waits for the holder of its key; zero: calls never wait.
    pub max: Duration,
    /// Calls of this process that may wait on one key at once.
    pub per_key: usize,
    /// Calls of this process that may wait at once, on all keys.
    pub per_process: usize,
}

/// What one call may wait for: until when (`None`: it does not wait), and the signal that its
/// caller has gone (its wait then ends at once: the answer would reach nobody).
#[derive(Clone, Debug, Default)]
pub struct WaitBudget {
    pub until: Option<Instant>,
    pub gone: CancellationToken,
}

impl WaitBudget {
    /// A call that does not wait.
    pub fn none() -> WaitBudget {
        WaitBudget::default()
    }
}

/// How a wait ended.
#[derive(Debug)]
pub enum WaitEnd {
    /// The key finished with this outcome: answer it as a replay.
    Finished(StoredResponse),
    /// The key is free (let go without finishing, or its lock expired): claim it again.
    Free,
    /// The wait is over without either: answer `IDEMPOTENCY_KEY_IN_USE`. `waited`: after
    /// waiting (until the call's deadline, or its caller left), not refused a wait at once.
    Over { waited: bool },
}

/// What the waiters of a key last heard.
#[derive(Clone, Debug)]
enum News {
    Running,
    Finished(StoredResponse),
    Free,
}

type KeyId = (i64, IdempotencyKey);

struct Entry {
    news: watch::Sender<News>,
    /// Attempts of this process that own the key (one, but for a moment during a takeover).
    holders: usize,
    waiters: usize,
    next_poll: Instant,
    poll_gap: Duration,
}

#[derive(Default)]
struct Inner {
    keys: HashMap<KeyId, Entry>,
    waiting: usize,
}

/// The keys of this process that have a holder or waiters, one per process.
pub struct Waits {
    config: WaitConfig,
    inner: Mutex<Inner>,
}

impl Waits {
    pub fn new(config: WaitConfig) -> Waits {
        Waits {
            config,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn config(&self) -> WaitConfig {
        self.config
    }

    fn locked(&self) -> MutexGuard<'_, Inner> {
        // Counters and channels only, valid at every step: a panic elsewhere cannot tear them.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// This attempt owns `key`: its waiters hear from it, not from the database, until the
    /// returned guard is finished or dropped.
    pub fn hold(&self, user_id: i64, key: &IdempotencyKey) -> Holding<'_> {
        let id = (user_id, key.clone());
        let mut inner = self.locked();
        let entry = inner.keys.entry(id.clone()).or_insert_with(new_entry);
        entry.holders += 1;
        entry.news.send_replace(News::Running);
        Holding {
            waits: self,
            id,
            left: false,
        }
    }

    /// Waits, within `budget`, for the attempt that holds `key` to finish or let it go.
    pub async fn wait(
        &self,
        pool: &Pool,
        user_id: i64,
        key: &IdempotencyKey,
        rule: LockRule,
        budget: &WaitBudget,
    ) -> WaitEnd {
        let Some(until) = budget.until else {
            return WaitEnd::Over { waited: false };
        };
        let Some(mut waiter) = self.join(user_id, key) else {
            count("refused");
            return WaitEnd::Over { waited: false };
        };
        // A holder here that finished just before this call joined: its news is still there.
        if let News::Finished(stored) = &*waiter.news.borrow_and_update() {
            count("finished");
            return WaitEnd::Finished(stored.clone());
        }
        let end = loop {
            let wake = self.next_poll(&waiter.id).map_or(until, |at| at.min(until));
            tokio::select! {
                changed = waiter.news.changed() => {
                    // The entry, and so its sender, lives as long as this waiter.
                    if changed.is_err() {
                        break WaitEnd::Over { waited: true };
                    }
                    match &*waiter.news.borrow_and_update() {
                        News::Finished(stored) => break WaitEnd::Finished(stored.clone()),
                        News::Free => break WaitEnd::Free,
                        News::Running => {}
                    }
                }
                () = tokio::time::sleep_until(wake.into()) => {
                    if Instant::now() >= until {
                        break WaitEnd::Over { waited: true };
                    }
                    if self.take_poll(&waiter.id) {
                        let polled = tokio::time::timeout_at(
                            until.into(),
                            poll(pool, user_id, key, rule),
                        );
                        match polled.await {
                            Ok(Ok(news)) => self.tell(&waiter.id, news),
                            Ok(Err(error)) => {
                                tracing::debug!(%error, "could not poll a key in use");
                            }
                            Err(_elapsed) => {}
                        }
                    }
                }
                () = budget.gone.cancelled() => break WaitEnd::Over { waited: true },
            }
        };
        count(match &end {
            WaitEnd::Finished(_) => "finished",
            WaitEnd::Free => "free",
            WaitEnd::Over { .. } if budget.gone.is_cancelled() => "caller_gone",
            WaitEnd::Over { .. } => "timed_out",
        });
        end
    }

    /// Joins the waiters of `key`, within the bounds; `None` if either is reached.
    fn join(&self, user_id: i64, key: &IdempotencyKey) -> Option<Waiter<'_>> {
        let id = (user_id, key.clone());
        let mut guard = self.locked();
        let inner = &mut *guard;
        if inner.waiting >= self.config.per_process {
            return None;
        }
        let entry = inner.keys.entry(id.clone()).or_insert_with(new_entry);
        if entry.waiters >= self.config.per_key {
            if entry.waiters == 0 && entry.holders == 0 {
                inner.keys.remove(&id);
            }
            return None;
        }
        entry.waiters += 1;
        inner.waiting += 1;
        let news = entry.news.subscribe();
        Some(Waiter {
            waits: self,
            id,
            news,
        })
    }

    /// When the waiters of `id` should next read the key row; `None` while a holder here will
    /// tell them.
    fn next_poll(&self, id: &KeyId) -> Option<Instant> {
        let inner = self.locked();
        let entry = inner.keys.get(id)?;
        (entry.holders == 0).then_some(entry.next_poll)
    }

    /// Whether this waiter makes the poll that is due (one per gap among the key's waiters).
    fn take_poll(&self, id: &KeyId) -> bool {
        let now = Instant::now();
        let mut inner = self.locked();
        let Some(entry) = inner.keys.get_mut(id) else {
            return false;
        };
        if entry.holders > 0 || now < entry.next_poll {
            return false;
        }
        entry.next_poll = now + entry.poll_gap;
        entry.poll_gap = (entry.poll_gap * 2).min(MAX_POLL_GAP);
        true
    }

    /// Passes what a poll found to every waiter of `id`.
    fn tell(&self, id: &KeyId, news: News) {
        if matches!(news, News::Running) {
            return;
        }
        if let Some(entry) = self.locked().keys.get(id) {
            entry.news.send_replace(news);
        }
    }

    /// A holder is done with `id`: finished (`outcome` builds its stored answer) or let go
    /// (`None`). The answer is built only if someone on this process can still hear it (a
    /// waiter, or another holder's later waiters): a fresh ride nobody waits for skips it.
    fn leave_holding(&self, id: &KeyId, outcome: Option<impl FnOnce() -> StoredResponse>) {
        let mut guard = self.locked();
        let Some(entry) = guard.keys.get_mut(id) else {
            return;
        };
        entry.holders = entry.holders.saturating_sub(1);
        if entry.holders == 0 && entry.waiters == 0 {
            guard.keys.remove(id);
            return;
        }
        entry.news.send_replace(match outcome {
            Some(outcome) => News::Finished(outcome()),
            None => News::Free,
        });
        // Waiters left poll afresh, should another process take the key.
        entry.next_poll = Instant::now() + FIRST_POLL;
        entry.poll_gap = FIRST_POLL;
    }

    /// A waiter is done with `id`; the entry goes once nobody is left.
    fn leave_waiting(&self, id: &KeyId) {
        let mut guard = self.locked();
        let inner = &mut *guard;
        let Some(entry) = inner.keys.get_mut(id) else {
            return;
        };
        entry.waiters = entry.waiters.saturating_sub(1);
        inner.waiting = inner.waiting.saturating_sub(1);
        if entry.holders == 0 && entry.waiters == 0 {
            inner.keys.remove(id);
        }
    }
}

fn new_entry() -> Entry {
    Entry {
        news: watch::Sender::new(News::Running),
        holders: 0,
        waiters: 0,
        next_poll: Instant::now() + FIRST_POLL,
        poll_gap: FIRST_POLL,
    }
}

fn count(outcome: &'static str) {
    metrics().waits.add(1, &[attr("outcome", outcome)]);
}

/// An attempt that owns a key on this process. Dropped without [`Holding::finished`], it tells
/// the key's waiters that the key is free again (after the attempt unlocked it, or its lock was
/// taken over: they claim again and learn which).
pub struct Holding<'a> {
    waits: &'a Waits,
    id: KeyId,
    left: bool,
}

impl Holding<'_> {
    /// The key finished (committed) with the outcome `outcome` builds: the waiters answer it as a
    /// replay. Built only when this process has waiters to tell.
    pub fn finished(mut self, outcome: impl FnOnce() -> StoredResponse) {
        self.left = true;
        self.waits.leave_holding(&self.id, Some(outcome));
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        if !self.left {
            self.waits
                .leave_holding(&self.id, None::<fn() -> StoredResponse>);
        }
    }
}

struct Waiter<'a> {
    waits: &'a Waits,
    id: KeyId,
    news: watch::Receiver<News>,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.waits.leave_waiting(&self.id);
    }
}

/// The key as a waiter needs it: finished (with its outcome), still locked by a live attempt, or
/// free (let go, or its lock may be taken over: expired, or its holder gone, as `rule` says). A
/// plain indexed read, no row lock taken; a key that vanished (reaped) is free: the claim that
/// follows decides it.
async fn poll(
    pool: &Pool,
    user_id: i64,
    key: &IdempotencyKey,
    rule: LockRule,
) -> Result<News, StoreError> {
    type Row = (RecoveryPoint, Option<i32>, Option<schema::JsonText>, String);
    let mut conn = pool.get().await.map_err(StoreError::Unavailable)?;
    let row: Option<Row> = idempotency_keys::table
        .filter(idempotency_keys::user_id.eq(user_id))
        .filter(idempotency_keys::idempotency_key.eq(key.as_str()))
        .select((
            idempotency_keys::recovery_point,
            idempotency_keys::response_code,
            idempotency_keys::response_body,
            lock_state_of_key(rule),
        ))
        .first(&mut conn)
        .await
        .optional()?;
    metrics().wait_polls.add(1, &[]);
    let Some((point, code, body, state)) = row else {
        return Ok(News::Free);
    };
    Ok(if point == RecoveryPoint::Finished {
        News::Finished(stored_response(code, body)?)
    } else if LockState::parse(&state).is_live() {
        News::Running
    } else {
        News::Free
    })
}

/// When a call's wait must end: started at `started`, it may wait `config.max`, or less if it
/// asked for less (`requested`, its `idempotency-wait`), and must answer before its deadline
/// (the smaller of its `grpc-timeout` and the server's own) less a margin for the answer to
/// reach it. `None`: it does not wait.
pub fn wait_until(
    config: WaitConfig,
    started: Instant,
    requested: Option<Duration>,
    deadline: Duration,
) -> Option<Instant> {
    let margin = (deadline / 10).clamp(Duration::from_millis(20), Duration::from_millis(500));
    let wait = config
        .max
        .min(requested.unwrap_or(Duration::MAX))
        .min(deadline.saturating_sub(margin));
    if wait.is_zero() {
        return None;
    }
    started.checked_add(wait)
}

#[cfg(test)]
mod tests;
