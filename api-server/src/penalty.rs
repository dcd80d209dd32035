//! Peers whose calls keep being refused before the database: bad credentials
//! (`UNAUTHENTICATED`, `PERMISSION_DENIED`) and limits (`RESOURCE_EXHAUSTED`). Answering such a
//! call costs the server a whole gRPC exchange, about 60 µs of CPU; a flood of them, from a peer
//! that ignores the answers (and their `RetryInfo`), takes the CPU that PostgreSQL and everyone
//! else need. So each peer address has a budget of refusals (a token bucket); a peer that spends
//! it is *shut out* for a cool-down: its connections are closed (`listener::Conn` ends their
//! reads) and new ones are refused at accept, where a refusal costs an accept and a close.
//!
//! A client that honours `RetryInfo` is refused a few times a second at most and never comes
//! near the budget. Peers behind one address (a NAT, a proxy) share it: raise
//! `GRPC_REFUSALS_PER_IP_PER_SEC` there, as `GRPC_MAX_CONNECTIONS_PER_IP`.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use crate::limits::{Bucket, Rate};

/// At most this many peer addresses are tracked; beyond it a new peer is not counted (the
/// connection caps still bound it). Peers with a full budget are forgotten at each sweep.
const MAX_TRACKED_PEERS: usize = 100_000;
const SWEEP_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PenaltyConfig {
    /// Refusals a peer may earn: refill per second, and the bucket (burst).
    pub refusals: Rate,
    /// How long a peer that spent its budget is shut out.
    pub cooldown: Duration,
}

#[derive(Debug)]
struct Peer {
    budget: Bucket,
    shut_out_until: Option<Instant>,
}

#[derive(Debug)]
struct Peers {
    by_address: HashMap<IpAddr, Peer>,
    last_sweep: Instant,
}

#[derive(Debug)]
pub struct Penalties {
    config: PenaltyConfig,
    peers: Mutex<Peers>,
    /// Peers shut out now or lately: while 0, the check on every read takes no lock.
    shut_out: AtomicUsize,
}

impl Penalties {
    pub fn new(config: PenaltyConfig) -> Penalties {
        Penalties {
            config,
            peers: Mutex::new(Peers {
                by_address: HashMap::new(),
                last_sweep: Instant::now(),
            }),
            shut_out: AtomicUsize::new(0),
        }
    }

    /// Counts one refusal of `peer`; true if it has now spent its budget and is shut out.
    pub fn record_refusal(&self, peer: IpAddr) -> bool {
        let now = Instant::now();
        let mut peers = self.locked();
        if now.saturating_duration_since(peers.last_sweep) >= SWEEP_INTERVAL {
            self.sweep(&mut peers, now);
        }
        if peers.by_address.len() >= MAX_TRACKED_PEERS && !peers.by_address.contains_key(&peer) {
            return false;
        }
        let rate = self.config.refusals;
        let entry = peers.by_address.entry(peer).or_insert_with(|| Peer {
            budget: Bucket::full(rate, now),
            shut_out_until: None,
        });
        if entry.shut_out_until.is_some_and(|until| until > now) {
            return true;
        }
        if entry.budget.take(rate, now).is_ok() {
            return false;
        }
        if entry.shut_out_until.is_none() {
            self.shut_out.fetch_add(1, Ordering::Relaxed);
        }
        entry.shut_out_until = Some(now + self.config.cooldown);
        tracing::warn!(
            %peer,
            cooldown_secs = self.config.cooldown.as_secs(),
            "peer shut out: too many refused calls"
        );
        true
    }

    /// Whether `peer` is shut out now.
    pub fn is_shut_out(&self, peer: IpAddr) -> bool {
        if self.shut_out.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let now = Instant::now();
        self.locked()
            .by_address
            .get(&peer)
            .and_then(|p| p.shut_out_until)
            .is_some_and(|until| until > now)
    }

    /// Forgets peers whose cool-down is over and whose budget has refilled.
    fn sweep(&self, peers: &mut Peers, now: Instant) {
        let rate = self.config.refusals;
        let mut released = 0;
        peers.by_address.retain(|_, peer| {
            if peer.shut_out_until.is_some_and(|until| until > now) {
                return true;
            }
            if peer.shut_out_until.take().is_some() {
                released += 1;
            }
            !peer.budget.is_full(rate, now)
        });
        self.shut_out.fetch_sub(released, Ordering::Relaxed);
        peers.last_sweep = now;
    }

    fn locked(&self) -> MutexGuard<'_, Peers> {
        self.peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn penalties(cooldown: Duration) -> Penalties {
        Penalties::new(PenaltyConfig {
            refusals: Rate {
                per_sec: 0.001,
                burst: 3.0,
            },
            cooldown,
        })
    }

    #[test]
    fn a_peer_is_shut_out_once_its_budget_is_spent_and_no_one_else_is() {
        let penalties = penalties(Duration::from_secs(60));
        let (peer, other) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        assert!(
            !penalties.is_shut_out(peer),
            "no lock taken while no one is shut out"
        );
        for _ in 0..3 {
            assert!(!penalties.record_refusal(peer));
        }
        assert!(!penalties.is_shut_out(peer));
        assert!(penalties.record_refusal(peer));
        assert!(penalties.is_shut_out(peer));
        assert!(!penalties.is_shut_out(other));
    }

    #[test]
    fn the_cool_down_ends() {
        let penalties = penalties(Duration::ZERO);
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        for _ in 0..4 {
            penalties.record_refusal(peer);
        }
        assert!(!penalties.is_shut_out(peer));
    }
}
