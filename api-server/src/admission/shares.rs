//! Fair shares between internal services. With mutual TLS every calling service is known by its
//! client certificate (`peer::PeerKey::Service`), and each gets its own fair share of CreateRide
//! concurrency and of the token-lookup places, so one misbehaving backend (a retry storm, a flood
//! of cold or made-up tokens) cannot starve another.
//!
//! A service alone may use everything: shares only bind when several services have calls in
//! flight. Then each may hold at most `budget / services` places (at least one), and a service at
//! its share is refused (`RESOURCE_EXHAUSTED`/`RATE_LIMITED`, `reason` label `service_share`)
//! while the others are served. The budgets default far above one api-server's capacity (a few
//! hundred CreateRides in flight with a 250 ms provider), so a share refuses nobody below
//! capacity; what it bounds is one service's take when the server is overloaded.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

/// A client certificate's SHA-256 digest.
pub type Service = [u8; 32];

pub struct Shares {
    budget: usize,
    held: Mutex<HashMap<Service, usize>>,
}

/// One place of a service's share, given back on drop.
#[derive(Debug)]
pub struct SharePermit {
    shares: Arc<Shares>,
    service: Service,
}

impl std::fmt::Debug for Shares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shares")
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl Shares {
    pub fn new(budget: usize) -> Arc<Shares> {
        Arc::new(Shares {
            budget,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// A place for `service`, unless it is at its share while other services have calls too.
    pub fn take(self: &Arc<Self>, service: Service) -> Option<SharePermit> {
        let mut held = self.locked();
        let mine = held.get(&service).copied().unwrap_or(0);
        let services = held.len() + usize::from(mine == 0);
        let share = (self.budget / services).max(1);
        if services > 1 && mine >= share {
            return None;
        }
        *held.entry(service).or_insert(0) += 1;
        Some(SharePermit {
            shares: Arc::clone(self),
            service,
        })
    }

    /// Services with calls in flight now.
    pub fn services(&self) -> usize {
        self.locked().len()
    }

    fn locked(&self) -> MutexGuard<'_, HashMap<Service, usize>> {
        // Counters only, valid at every step: a panic elsewhere cannot leave them torn.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for SharePermit {
    fn drop(&mut self) {
        let mut held = self.shares.locked();
        if let Some(count) = held.get_mut(&self.service) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.service);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_service_alone_uses_everything_and_shares_once_another_comes() {
        let shares = Shares::new(4);
        let (a, b) = ([1; 32], [2; 32]);
        let a_places: Vec<_> = (0..6).map(|_| shares.take(a).unwrap()).collect();
        // B is served though A holds more than the budget...
        let b_first = shares.take(b).unwrap();
        // ...and A, over its share of 2, is refused while B is active.
        assert!(shares.take(a).is_none());
        let _b_second = shares.take(b).unwrap();
        assert!(shares.take(b).is_none(), "B over its share of 2");
        // Once B is done, A is alone again.
        drop(b_first);
        drop(_b_second);
        assert_eq!(shares.services(), 1);
        let _more = shares.take(a).unwrap();
        drop(a_places);
        assert_eq!(shares.services(), 1);
    }

    #[test]
    fn every_service_gets_at_least_one_place() {
        let shares = Shares::new(2);
        let permits: Vec<_> = (0..5_u8).map(|n| shares.take([n; 32]).unwrap()).collect();
        assert_eq!(shares.services(), 5);
        assert!(shares.take([0; 32]).is_none());
        drop(permits);
        assert_eq!(shares.services(), 0);
    }
}
