//! Peers that keep failing authentication: unknown, malformed or revoked credentials, and
//! on-behalf-of misuse (`UNAUTHENTICATED`, `PERMISSION_DENIED`). Answering such a call costs the
//! server a whole gRPC exchange, and each new made-up token a database lookup; a flood of them,
//! from a peer that ignores the answers, takes the CPU and the lookups that PostgreSQL and
//! everyone else need. So each peer address has a budget of failed authentications (a token
//! bucket); a peer that spends it is *shut out* for a cool-down: new connections are refused at
//! accept, and its connections are closed (`listener::Conn` ends their reads).
//!
//! **Penalties fall on attackers only.** Nothing else counts: a rate limit, a busy lookup queue
//! or any other answer that says the server or a user's budget is busy is the server's choice,
//! not the peer's fault. And a peer that presented a valid credential in the last
//! [`VALID_CREDENTIAL_MEMORY`] is never shut out: that is a backend carrying riders' calls (one
//! address for many riders behind a proxy or a mesh), and shutting it out would be an outage for
//! all of them. Since every admitted call presented a valid credential, no shut-out ever cuts a
//! call already admitted. Calls with the internal credential and services authenticated by a
//! client certificate are keyed by that identity and never counted (`admission::peer`).

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
/// connection caps still bound it). Peers with a full budget and no recent valid credential are
/// forgotten at each sweep.
const MAX_TRACKED_PEERS: usize = 100_000;
/// How long a valid credential vouches for its peer address. Longer than any call may run
/// (`GRPC_REQUEST_TIMEOUT_SECS` is at most this, see `config`), so an admitted call's own peer is
/// never shut out while it runs.
pub const VALID_CREDENTIAL_MEMORY: Duration = Duration::from_secs(600);
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
    /// Until when a valid credential from this address vouches for it.
    vouched_until: Option<Instant>,
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

    /// Counts one failed authentication of `peer`; true if it is now shut out.
    pub fn record_failed_auth(&self, peer: IpAddr) -> bool {
        let now = Instant::now();
        let mut peers = self.locked();
        let Some(entry) = self.entry(&mut peers, peer, now) else {
            return false;
        };
        if entry.vouched_until.is_some_and(|until| until > now) {
            return false;
        }
        if entry.shut_out_until.is_some_and(|until| until > now) {
            return true;
        }
        if entry.budget.take(self.config.refusals, now).is_ok() {
            return false;
        }
        if entry.shut_out_until.is_none() {
            self.shut_out.fetch_add(1, Ordering::Relaxed);
        }
        entry.shut_out_until = Some(now + self.config.cooldown);
        tracing::warn!(
            %peer,
            cooldown_secs = self.config.cooldown.as_secs(),
            "peer shut out: too many failed authentications"
        );
        true
    }

    /// Records that `peer` presented a valid credential: it is not shut out from now on (a
    /// shut-out in force ends) for [`VALID_CREDENTIAL_MEMORY`].
    pub fn record_valid(&self, peer: IpAddr) {
        let now = Instant::now();
        let mut peers = self.locked();
        let Some(entry) = self.entry(&mut peers, peer, now) else {
            return;
        };
        // Refreshed at most once a minute: the common case is a read under the lock.
        if entry
            .vouched_until
            .is_some_and(|until| until > now + VALID_CREDENTIAL_MEMORY - Duration::from_secs(60))
        {
            return;
        }
        entry.vouched_until = Some(now + VALID_CREDENTIAL_MEMORY);
        if entry.shut_out_until.take().is_some() {
            self.shut_out.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The entry of `peer`, added if there is room; the table is swept on the way.
    fn entry<'a>(&self, peers: &'a mut Peers, peer: IpAddr, now: Instant) -> Option<&'a mut Peer> {
        if now.saturating_duration_since(peers.last_sweep) >= SWEEP_INTERVAL {
            self.sweep(peers, now);
        }
        if peers.by_address.len() >= MAX_TRACKED_PEERS && !peers.by_address.contains_key(&peer) {
            return None;
        }
        let rate = self.config.refusals;
        Some(peers.by_address.entry(peer).or_insert_with(|| Peer {
            budget: Bucket::full(rate, now),
            shut_out_until: None,
            vouched_until: None,
        }))
    }

    /// Whether `peer` is shut out now.
    pub fn is_shut_out(&self, peer: IpAddr) -> bool {
        self.shut_out_for(peer).is_some()
    }

    /// How long `peer` stays shut out, if it is now.
    pub fn shut_out_for(&self, peer: IpAddr) -> Option<Duration> {
        // While nobody is shut out, the check on every read takes no lock.
        if self.shut_out.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let now = Instant::now();
        self.locked()
            .by_address
            .get(&peer)
            .and_then(|p| p.shut_out_until)
            .filter(|until| *until > now)
            .map(|until| until - now)
    }

    /// Forgets peers whose cool-down is over, whose budget has refilled and whom no valid
    /// credential vouches for.
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
            peer.vouched_until.is_some_and(|until| until > now) || !peer.budget.is_full(rate, now)
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
            assert!(!penalties.record_failed_auth(peer));
        }
        assert!(!penalties.is_shut_out(peer));
        assert!(penalties.record_failed_auth(peer));
        assert!(penalties.is_shut_out(peer));
        assert!(!penalties.is_shut_out(other));
    }

    #[test]
    fn the_cool_down_ends() {
        let penalties = penalties(Duration::ZERO);
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        for _ in 0..4 {
            penalties.record_failed_auth(peer);
        }
        assert!(!penalties.is_shut_out(peer));
    }

    #[test]
    fn a_peer_that_presented_a_valid_credential_is_never_shut_out() {
        let penalties = penalties(Duration::from_secs(60));
        let (backend, other): (IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        penalties.record_valid(backend);
        for _ in 0..100 {
            assert!(!penalties.record_failed_auth(backend));
        }
        assert!(!penalties.is_shut_out(backend));
        // A peer shut out before it presented a valid credential is let back in by it.
        for _ in 0..4 {
            penalties.record_failed_auth(other);
        }
        assert!(penalties.is_shut_out(other));
        penalties.record_valid(other);
        assert!(!penalties.is_shut_out(other));
    }
}
