//! Tokens verified lately, for admission only: a known token skips the token-lookup queue. The
//! claim still authenticates every CreateRide in its own statement (and GetRide reads the user),
//! so a token revoked within the TTL is still refused; it merely skips the queue until then.
//!
//! **Why two generations.** Riders call rarely: a cache that forgets a rider after a minute makes
//! nearly every call cold. Entries here live for at least half the TTL after their last use and at
//! most the whole TTL: the current generation takes new and re-used digests, and every half TTL
//! (or when it holds half the capacity) it becomes the previous one, and the previous one is
//! dropped whole. That is O(1) per call with no per-entry timestamps and no expiry queue.
//!
//! **Memory.** A digest is kept as its first 16 bytes (a forged match needs a 2^128 preimage, and
//! a match only skips the queue) with the user id: 24 bytes and a control byte in a hash map that
//! is at most 7/8 full, so at most ~64 bytes per entry in the worst case of both generations grown
//! to half the capacity: 1,000,000 digests (the default) fit in about 64 MB, and only
//! authenticated callers can add one.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

type Prefix = [u8; 16];

fn prefix(digest: &[u8; 32]) -> Prefix {
    let mut prefix = [0; 16];
    prefix.copy_from_slice(&digest[..16]);
    prefix
}

pub struct KnownTokens {
    half_life: Duration,
    /// Entries one generation may hold before it is rotated early.
    per_generation: usize,
    inner: Mutex<Generations>,
}

struct Generations {
    current: HashMap<Prefix, i64>,
    previous: HashMap<Prefix, i64>,
    rotated: Instant,
}

impl KnownTokens {
    /// `ttl`: how long an unused token stays known at most; `capacity`: digests held at most.
    pub fn new(ttl: Duration, capacity: usize) -> KnownTokens {
        KnownTokens {
            half_life: ttl / 2,
            per_generation: capacity / 2,
            inner: Mutex::new(Generations {
                current: HashMap::new(),
                previous: HashMap::new(),
                rotated: Instant::now(),
            }),
        }
    }

    /// The user of a token verified lately; a hit counts as a use and keeps the token known.
    pub fn get(&self, digest: &[u8; 32]) -> Option<i64> {
        let key = prefix(digest);
        let mut inner = self.locked();
        self.rotate_if_due(&mut inner);
        if let Some(user_id) = inner.current.get(&key) {
            return Some(*user_id);
        }
        let user_id = inner.previous.remove(&key)?;
        self.insert_current(&mut inner, key, user_id);
        Some(user_id)
    }

    pub fn insert(&self, digest: &[u8; 32], user_id: i64) {
        if self.per_generation == 0 {
            return;
        }
        let key = prefix(digest);
        let mut inner = self.locked();
        self.rotate_if_due(&mut inner);
        inner.previous.remove(&key);
        self.insert_current(&mut inner, key, user_id);
    }

    /// Forgets a token the database no longer knows (revoked, or its user deleted).
    pub fn remove(&self, digest: &[u8; 32]) {
        let key = prefix(digest);
        let mut inner = self.locked();
        inner.current.remove(&key);
        inner.previous.remove(&key);
    }

    pub fn len(&self) -> usize {
        let inner = self.locked();
        inner.current.len() + inner.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert_current(&self, inner: &mut Generations, key: Prefix, user_id: i64) {
        if inner.current.len() >= self.per_generation && !inner.current.contains_key(&key) {
            Self::rotate(inner);
        }
        inner.current.insert(key, user_id);
    }

    fn rotate_if_due(&self, inner: &mut Generations) {
        let age = inner.rotated.elapsed();
        if age >= self.half_life * 2 {
            // Idle for a whole TTL: both generations are stale.
            inner.previous.clear();
            inner.current.clear();
            inner.rotated = Instant::now();
        } else if age >= self.half_life {
            let due = inner.rotated.checked_add(self.half_life);
            Self::rotate(inner);
            // On the schedule, not at this call: an entry never outlives the TTL because the
            // cache happened to be idle when its rotation was due.
            if let Some(due) = due {
                inner.rotated = due;
            }
        }
    }

    fn rotate(inner: &mut Generations) {
        inner.previous = std::mem::take(&mut inner.current);
        inner.rotated = Instant::now();
    }

    fn locked(&self) -> MutexGuard<'_, Generations> {
        // Plain maps, valid at every step: a panic elsewhere cannot leave them torn.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> [u8; 32] {
        [n; 32]
    }

    #[test]
    fn a_token_in_use_stays_known_across_rotations() {
        let known = KnownTokens::new(Duration::from_millis(200), 100);
        known.insert(&digest(1), 7);
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(60));
            assert_eq!(known.get(&digest(1)), Some(7), "dropped while in use");
        }
    }

    #[test]
    fn an_unused_token_is_forgotten_within_the_ttl() {
        let known = KnownTokens::new(Duration::from_millis(100), 100);
        known.insert(&digest(1), 7);
        std::thread::sleep(Duration::from_millis(60));
        known.insert(&digest(2), 8);
        std::thread::sleep(Duration::from_millis(60));
        // 120 ms unused: past the TTL, so gone whatever the rotation phase.
        assert_eq!(known.get(&digest(1)), None);
    }

    #[test]
    fn the_capacity_bounds_both_generations() {
        let known = KnownTokens::new(Duration::from_secs(3600), 4);
        for n in 0..10 {
            known.insert(&digest(n), i64::from(n));
            assert!(known.len() <= 4, "{} entries", known.len());
        }
        // The newest are kept.
        assert_eq!(known.get(&digest(9)), Some(9));
        assert_eq!(known.get(&digest(0)), None);
    }

    #[test]
    fn a_removed_token_is_unknown() {
        let known = KnownTokens::new(Duration::from_secs(3600), 10);
        known.insert(&digest(1), 7);
        known.remove(&digest(1));
        assert_eq!(known.get(&digest(1)), None);
        assert!(known.is_empty());
    }
}
