//! Per-user limits, decided in memory before any database work, and the caches that keep bad
//! credentials away from the database.
//!
//! **Who is a user here.** The CreateRide fast path authenticates a token inside the claim's own
//! statement, so before the database the only thing known about a caller is its token. Every
//! user has exactly one token (`users.api_token_digest`, unique and not null), so the token's
//! digest identifies a user: the limits are kept per [`Caller`], a token digest or, for the
//! completer's internal credential, the `on-behalf-of-user` id.
//!
//! **The completer is not starved by its users.** Its calls are limited per on-behalf-of user, in
//! buckets of their own ([`Caller::OnBehalfOf`]), so a user flooding with their own token cannot
//! use up what the completer needs to finish that user's keys; and the completer only resumes keys
//! that exist, which the decline budget never refuses.
//!
//! **The decline budget.** After `decline_budget` fresh `CARD_DECLINED` answers within
//! [`DECLINE_WINDOW`], a caller's *new* keys are refused until the window frees a place. The
//! declines are counted from the database, across every replica (`admission::declines`); this
//! process keeps only "spent until" per caller, so refusing costs no database work but one check:
//! whether the key is new, which is known only from the database
//! ([`crate::idempotency::key_exists`], one read-only indexed lookup made only for a caller whose
//! budget is spent, so everyone else pays nothing and a card tester's refused attempts write
//! nothing). Replays and resumptions of existing keys go on.
//!
//! **Bounded memory.** Buckets are tracked for at most `max_tracked_callers` callers; a caller
//! whose buckets have refilled and who has no CreateRide in flight is forgotten (it would get a
//! full bucket again anyway). Callers whose token turned out to be unknown are forgotten at once,
//! so random tokens do not fill the table; when it is full of active callers, new callers are
//! refused (`RATE_LIMITED`) until some go idle. Decline windows live in a table of their own that
//! only authenticated callers' declines enter, so a flood of bad tokens cannot flush them.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use crate::auth::Caller;

/// The settings that lift every per-user limit, for callers that are not real users: the test
/// harness, and the reliability campaign's closed-loop clients (hundreds of calls per second per
/// user, many of them declined), which prove exactly-once under crashes, not the limits. The
/// token lookups are not lifted: they refuse nobody below capacity (`admission::lookup`).
pub const LIFTED: &[(&str, &str)] = &[
    ("RATE_LIMIT_CREATE_PER_SEC", "1000000"),
    ("RATE_LIMIT_CREATE_BURST", "1000000"),
    ("RATE_LIMIT_GET_PER_SEC", "1000000"),
    ("RATE_LIMIT_GET_BURST", "1000000"),
    ("MAX_CONCURRENT_CREATES_PER_USER", "1000000"),
    ("DECLINE_BUDGET_PER_10_MIN", "1000000"),
    ("GRPC_REFUSALS_PER_IP_PER_SEC", "1000000"),
];

/// How long the decline budget's window lasts.
pub const DECLINE_WINDOW: Duration = Duration::from_secs(600);
/// How often the bucket table is swept of idle callers.
const SWEEP_INTERVAL: Duration = Duration::from_secs(10);
/// The retry hint for refusals that no refill time decides (concurrency, a full table).
const RETRY_SOON: Duration = Duration::from_secs(1);

/// A token bucket's refill rate and size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    pub per_sec: f64,
    pub burst: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LimitsConfig {
    pub create: Rate,
    pub get: Rate,
    pub max_concurrent_creates: u32,
    /// Fresh card declines per [`DECLINE_WINDOW`] before new keys are refused.
    pub decline_budget: u32,
    pub max_tracked_callers: usize,
    /// How long an unknown token digest is answered from memory. A token whose user is created
    /// (or restored) after it was tried is refused for at most this long.
    pub unknown_token_ttl: Duration,
    pub unknown_token_capacity: usize,
    /// How long a verified token stays known without being used (`admission::known`).
    pub known_token_ttl: Duration,
    pub known_token_capacity: usize,
    /// Token lookups that may run at once; `None`: half the database pool.
    pub max_concurrent_token_lookups: Option<usize>,
    /// Calls that may wait for a lookup place at once, and how long each may wait.
    pub token_lookup_queue: usize,
    pub token_lookup_wait: Duration,
    /// CreateRides in flight shared fairly among certificate-authenticated services
    /// (`admission::shares`).
    pub service_share_creates: usize,
}

/// A refused call, with how long to wait before trying again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub retry_after: Duration,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl Bucket {
    pub(crate) fn full(rate: Rate, now: Instant) -> Bucket {
        Bucket {
            tokens: rate.burst,
            updated: now,
        }
    }

    fn refill(&mut self, rate: Rate, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate.per_sec).min(rate.burst);
        self.updated = now;
    }

    /// Takes one token, or says how long until one is there.
    pub(crate) fn take(&mut self, rate: Rate, now: Instant) -> Result<(), Refusal> {
        self.refill(rate, now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        let wait = (1.0 - self.tokens) / rate.per_sec;
        Err(Refusal {
            retry_after: Duration::try_from_secs_f64(wait).unwrap_or(DECLINE_WINDOW),
        })
    }

    pub(crate) fn is_full(&self, rate: Rate, now: Instant) -> bool {
        let mut bucket = *self;
        bucket.refill(rate, now);
        bucket.tokens >= rate.burst
    }
}

struct Entry {
    create: Bucket,
    get: Bucket,
    creates_in_flight: Arc<AtomicU32>,
}

struct Buckets {
    callers: HashMap<Caller, Entry>,
    last_sweep: Instant,
}

/// The per-caller limits of one process.
pub struct Limiter {
    config: LimitsConfig,
    buckets: Mutex<Buckets>,
    /// Callers whose decline budget is spent, and until when.
    declines_spent: Mutex<HashMap<Caller, Instant>>,
}

/// One admitted CreateRide: it counts against its caller's concurrency until dropped.
#[derive(Debug)]
pub struct CreatePermit(Arc<AtomicU32>);

impl Drop for CreatePermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state is counters only, valid at every step: a panic elsewhere cannot leave it torn.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Limiter {
    pub fn new(config: LimitsConfig) -> Limiter {
        Limiter {
            config,
            buckets: Mutex::new(Buckets {
                callers: HashMap::new(),
                last_sweep: Instant::now(),
            }),
            declines_spent: Mutex::new(HashMap::new()),
        }
    }

    /// Admits one CreateRide: under the caller's concurrency cap, with a token from its bucket.
    pub fn admit_create(&self, caller: Caller) -> Result<CreatePermit, Refusal> {
        let config = self.config;
        self.with_entry(caller, |entry, now| {
            let in_flight = &entry.creates_in_flight;
            if in_flight.load(Ordering::Acquire) >= config.max_concurrent_creates {
                return Err(Refusal {
                    retry_after: RETRY_SOON,
                });
            }
            entry.create.take(config.create, now)?;
            in_flight.fetch_add(1, Ordering::AcqRel);
            Ok(CreatePermit(Arc::clone(in_flight)))
        })
    }

    /// Admits one GetRide, with a token from the caller's bucket.
    pub fn admit_get(&self, caller: Caller) -> Result<(), Refusal> {
        let rate = self.config.get;
        self.with_entry(caller, |entry, now| entry.get.take(rate, now))
    }

    /// Drops what is kept for a caller whose token turned out to be unknown.
    pub fn forget(&self, caller: Caller) {
        let mut buckets = locked(&self.buckets);
        if let Some(entry) = buckets.callers.get(&caller)
            && entry.creates_in_flight.load(Ordering::Acquire) == 0
        {
            buckets.callers.remove(&caller);
        }
    }

    fn with_entry<T>(
        &self,
        caller: Caller,
        admit: impl FnOnce(&mut Entry, Instant) -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        let now = Instant::now();
        let mut buckets = locked(&self.buckets);
        // No room for a caller the table does not hold yet.
        let no_room = |buckets: &Buckets| {
            buckets.callers.len() >= self.config.max_tracked_callers
                && !buckets.callers.contains_key(&caller)
        };
        let since_sweep = now.saturating_duration_since(buckets.last_sweep);
        // A full table is swept at most once a second, so a flood cannot make every call O(n).
        if since_sweep >= SWEEP_INTERVAL
            || (no_room(&buckets) && since_sweep >= Duration::from_secs(1))
        {
            self.sweep(&mut buckets, now);
        }
        if no_room(&buckets) {
            return Err(Refusal {
                retry_after: RETRY_SOON,
            });
        }
        let entry = buckets.callers.entry(caller).or_insert_with(|| Entry {
            create: Bucket::full(self.config.create, now),
            get: Bucket::full(self.config.get, now),
            creates_in_flight: Arc::new(AtomicU32::new(0)),
        });
        admit(entry, now)
    }

    /// Forgets callers whose buckets have refilled and who have nothing in flight.
    fn sweep(&self, buckets: &mut Buckets, now: Instant) {
        let config = self.config;
        buckets.callers.retain(|_, entry| {
            !(entry.create.is_full(config.create, now)
                && entry.get.is_full(config.get, now)
                && entry.creates_in_flight.load(Ordering::Acquire) == 0)
        });
        buckets.last_sweep = now;
    }

    /// Callers the table holds now: bounded by `max_tracked_callers`, swept as buckets refill.
    pub fn tracked_callers(&self) -> usize {
        locked(&self.buckets).callers.len()
    }

    /// Fresh card declines per [`DECLINE_WINDOW`] before new keys are refused.
    pub fn decline_budget(&self) -> u32 {
        self.config.decline_budget
    }

    /// Records that the caller's decline budget is spent for `frees_in` (counted across
    /// replicas by `admission::declines`).
    pub fn decline_budget_spent_for(&self, caller: Caller, frees_in: Duration) {
        let now = Instant::now();
        let mut spent = locked(&self.declines_spent);
        if !spent.contains_key(&caller) && spent.len() >= self.config.max_tracked_callers {
            spent.retain(|_, until| *until > now);
            if spent.len() >= self.config.max_tracked_callers {
                // Only authenticated callers whose budget the database says is spent get here;
                // so many at once is not a flood of strangers, and this one goes unrefused
                // rather than evicting another (its next decline records it again).
                tracing::warn!("decline budget table full; a spent budget was not recorded");
                return;
            }
        }
        spent.insert(caller, now + frees_in);
    }

    /// If the caller's decline budget is spent: how long until it frees a place. Its new keys
    /// are refused until then.
    pub fn decline_budget_spent(&self, caller: Caller) -> Option<Refusal> {
        let now = Instant::now();
        let until = *locked(&self.declines_spent).get(&caller)?;
        (until > now).then(|| Refusal {
            retry_after: until - now,
        })
    }
}

/// A bounded set of token digests remembered for a while, oldest dropped first: unknown tokens
/// (so that a repeated bad token does not reach the database) and recently authenticated ones
/// (so that their trace context is trusted without a lookup).
pub struct DigestCache {
    ttl: Duration,
    capacity: usize,
    inner: Mutex<DigestCacheInner>,
}

#[derive(Default)]
struct DigestCacheInner {
    expires: HashMap<[u8; 32], Instant>,
    order: VecDeque<([u8; 32], Instant)>,
}

impl DigestCache {
    pub fn new(ttl: Duration, capacity: usize) -> DigestCache {
        DigestCache {
            ttl,
            capacity,
            inner: Mutex::new(DigestCacheInner::default()),
        }
    }

    pub fn contains(&self, digest: &[u8; 32]) -> bool {
        let now = Instant::now();
        locked(&self.inner)
            .expires
            .get(digest)
            .is_some_and(|expires| *expires > now)
    }

    pub fn insert(&self, digest: [u8; 32]) {
        if self.capacity == 0 {
            return;
        }
        let now = Instant::now();
        let mut inner = locked(&self.inner);
        // Entries leave in insertion order, which (one TTL for all) is expiry order.
        while let Some(&(oldest, expires)) = inner.order.front() {
            if expires > now && inner.order.len() < self.capacity {
                break;
            }
            inner.order.pop_front();
            // Only if the map still holds this insertion, not a later one of the same digest.
            if inner.expires.get(&oldest) == Some(&expires) {
                inner.expires.remove(&oldest);
            }
        }
        // A digest still in use is kept: re-inserted once less than half its TTL is left, so an
        // active user's token never drops out, and each digest takes at most two places in
        // `order` per TTL.
        if inner
            .expires
            .get(&digest)
            .is_some_and(|at| at.saturating_duration_since(now) > self.ttl / 2)
        {
            return;
        }
        let expires = now + self.ttl;
        inner.expires.insert(digest, expires);
        inner.order.push_back((digest, expires));
    }

    pub fn remove(&self, digest: &[u8; 32]) {
        locked(&self.inner).expires.remove(digest);
    }

    pub fn len(&self) -> usize {
        locked(&self.inner).expires.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> LimitsConfig {
        LimitsConfig {
            create: Rate {
                per_sec: 0.001,
                burst: 2.0,
            },
            get: Rate {
                per_sec: 0.001,
                burst: 3.0,
            },
            max_concurrent_creates: 2,
            decline_budget: 2,
            max_tracked_callers: 2,
            unknown_token_ttl: Duration::from_secs(60),
            unknown_token_capacity: 2,
            known_token_ttl: Duration::from_secs(3600),
            known_token_capacity: 4,
            max_concurrent_token_lookups: Some(4),
            token_lookup_queue: 4,
            token_lookup_wait: Duration::from_secs(1),
            service_share_creates: 8,
        }
    }

    #[test]
    fn buckets_refuse_when_empty_with_the_time_to_the_next_token() {
        let limiter = Limiter::new(config());
        let caller = Caller::Token([1; 32]);
        for _ in 0..3 {
            limiter.admit_get(caller).unwrap();
        }
        let refusal = limiter.admit_get(caller).unwrap_err();
        assert!(refusal.retry_after > Duration::from_secs(900));
        assert!(refusal.retry_after <= Duration::from_secs(1000));
        // Another caller has its own bucket.
        limiter.admit_get(Caller::OnBehalfOf(1)).unwrap();
    }

    #[test]
    fn concurrency_is_capped_until_a_permit_is_dropped() {
        let mut config = config();
        config.create.burst = 10.0;
        let limiter = Limiter::new(config);
        let caller = Caller::Token([1; 32]);
        let first = limiter.admit_create(caller).unwrap();
        let _second = limiter.admit_create(caller).unwrap();
        assert_eq!(
            limiter.admit_create(caller).unwrap_err().retry_after,
            RETRY_SOON
        );
        drop(first);
        limiter.admit_create(caller).unwrap();
    }

    #[test]
    fn the_table_is_bounded_and_forgets_unknown_callers() {
        let limiter = Limiter::new(config());
        limiter.admit_get(Caller::Token([1; 32])).unwrap();
        limiter.admit_get(Caller::Token([2; 32])).unwrap();
        // Both are active (their buckets are not full): a third caller is refused...
        assert!(limiter.admit_get(Caller::Token([3; 32])).is_err());
        // ...until one is forgotten, as a caller with an unknown token is.
        limiter.forget(Caller::Token([1; 32]));
        limiter.admit_get(Caller::Token([3; 32])).unwrap();
    }

    #[test]
    fn a_spent_decline_budget_refuses_until_it_frees_a_place() {
        let limiter = Limiter::new(config());
        let caller = Caller::Token([1; 32]);
        assert_eq!(limiter.decline_budget_spent(caller), None);
        limiter.decline_budget_spent_for(caller, Duration::from_secs(300));
        let refusal = limiter.decline_budget_spent(caller).unwrap();
        assert!(refusal.retry_after <= Duration::from_secs(300));
        assert!(refusal.retry_after > Duration::from_secs(290));
        assert_eq!(limiter.decline_budget_spent(Caller::Token([2; 32])), None);
        limiter.decline_budget_spent_for(Caller::Token([2; 32]), Duration::ZERO);
        assert_eq!(limiter.decline_budget_spent(Caller::Token([2; 32])), None);
    }

    #[test]
    fn the_digest_cache_drops_the_oldest_beyond_its_capacity() {
        let cache = DigestCache::new(Duration::from_secs(60), 2);
        cache.insert([1; 32]);
        cache.insert([2; 32]);
        cache.insert([3; 32]);
        assert!(!cache.contains(&[1; 32]));
        assert!(cache.contains(&[2; 32]));
        assert!(cache.contains(&[3; 32]));
        assert_eq!(cache.len(), 2);
        cache.remove(&[2; 32]);
        assert!(!cache.contains(&[2; 32]));
    }

    #[test]
    fn the_digest_cache_keeps_a_digest_in_use_past_its_ttl() {
        let cache = DigestCache::new(Duration::from_millis(200), 10);
        cache.insert([1; 32]);
        std::thread::sleep(Duration::from_millis(120));
        cache.insert([1; 32]);
        std::thread::sleep(Duration::from_millis(120));
        assert!(cache.contains(&[1; 32]), "dropped while in use");
    }

    #[test]
    fn the_digest_cache_forgets_after_its_ttl() {
        let cache = DigestCache::new(Duration::ZERO, 10);
        cache.insert([1; 32]);
        assert!(!cache.contains(&[1; 32]));
    }
}
