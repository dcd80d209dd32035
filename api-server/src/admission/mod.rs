//! Admission: what is decided about a call before its own work starts. Built for this
//! service's real callers: internal backends that carry many riders' tokens over a few
//! connections from one address, riders who each call rarely, every token cold after a restart,
//! and the completer.
//!
//! - Who is calling ([`Caller`]) comes from the credentials alone (`grpc`).
//! - Per-user limits ([`crate::limits`]) refuse a user's excess, not their backend's.
//! - A token not verified lately is verified once ([`lookup`]: a short fair queue, one lookup for
//!   all concurrent calls with that token) and then stays known for `KNOWN_TOKEN_CACHE_TTL_SECS`
//!   ([`known`]); a token no user has is remembered as unknown for a while
//!   (`UNKNOWN_TOKEN_CACHE_TTL_MS`). The claim still authenticates every CreateRide in its own
//!   statement: the caches only decide who waits in the lookup queue.
//! - Failed authentication counts against the peer ([`crate::penalty`]), keyed by [`peer`]: its
//!   own address, the client a trusted proxy names, or its client certificate.
//! - Services identified by a client certificate get fair [`shares`] of CreateRide concurrency
//!   and of the token lookups.

pub mod declines;
pub mod known;
pub mod lookup;
pub mod peer;
pub mod proxy_protocol;
pub mod shares;

use std::sync::Arc;

use schema::Pool;

use crate::{
    auth::Caller,
    limits::{DigestCache, Limiter, LimitsConfig},
    penalty::Penalties,
};
use known::KnownTokens;
use lookup::{Found, LookupConfig, LookupError, TokenLookups};
use peer::{PeerInfo, PeerKey, TrustedProxies};
use shares::{SharePermit, Shares};

/// Why a caller's credential was not verified.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unverified {
    /// Already counted against the call's peer.
    #[error("no user has this token")]
    UnknownToken,
    #[error(transparent)]
    Lookup(#[from] LookupError),
    #[error("this service holds its share of the token lookups while others wait")]
    ServiceShare,
}

/// A service is at its share of CreateRides in flight while others have calls too.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("this service holds its share of the CreateRides in flight")]
pub struct ShareTaken;

pub struct Admission {
    pool: Pool,
    pub limiter: Limiter,
    /// Digests no user has: refused from memory for a while.
    unknown_tokens: DigestCache,
    known_tokens: KnownTokens,
    lookups: TokenLookups,
    penalties: Arc<Penalties>,
    trusted_proxies: TrustedProxies,
    create_shares: Arc<Shares>,
    lookup_shares: Arc<Shares>,
}

impl Admission {
    pub fn new(
        pool: Pool,
        pool_size: u32,
        limits: LimitsConfig,
        penalties: Arc<Penalties>,
        trusted_proxies: TrustedProxies,
    ) -> Admission {
        let places = limits
            .max_concurrent_token_lookups
            .unwrap_or_else(|| default_lookup_places(pool_size));
        Admission {
            create_shares: Shares::new(limits.service_share_creates),
            // A service's share of the lookups counts its calls running and waiting.
            lookup_shares: Shares::new(places.saturating_add(limits.token_lookup_queue)),
            lookups: TokenLookups::new(
                LookupConfig {
                    places,
                    max_waiting: limits.token_lookup_queue,
                    max_wait: limits.token_lookup_wait,
                },
                pool.clone(),
            ),
            limiter: Limiter::new(limits),
            unknown_tokens: DigestCache::new(
                limits.unknown_token_ttl,
                limits.unknown_token_capacity,
            ),
            known_tokens: KnownTokens::new(limits.known_token_ttl, limits.known_token_capacity),
            pool,
            penalties,
            trusted_proxies,
        }
    }

    /// Whether a token is known to have no user (refused without a lookup).
    pub fn is_unknown(&self, digest: &[u8; 32]) -> bool {
        self.unknown_tokens.contains(digest)
    }

    /// Verifies a caller's credential, from memory when it was verified lately. The internal
    /// credential was verified by comparison already. A call from a certificate-authenticated
    /// service waits for a lookup only within its share.
    ///
    /// A lookup runs to its end in a task of its own, and a token it finds no user for is
    /// counted against `peer` there ([`Unverified::UnknownToken`] is already counted): a caller
    /// whose deadline expires mid-lookup is dropped by tonic before it could count itself, and
    /// a flood of made-up tokens on short deadlines would otherwise never be shut out.
    pub async fn verify(
        self: &Arc<Self>,
        caller: Caller,
        peer: Option<PeerKey>,
    ) -> Result<(), Unverified> {
        let Caller::Token(digest) = caller else {
            return Ok(());
        };
        if self.known_tokens.get(&digest).is_some() {
            return Ok(());
        }
        let share = match peer {
            Some(PeerKey::Service(service)) => Some(
                self.lookup_shares
                    .take(service)
                    .ok_or(Unverified::ServiceShare)?,
            ),
            _ => None,
        };
        let admission = Arc::clone(self);
        let lookup = tokio::spawn(async move {
            let _share = share;
            let found = admission.lookups.lookup(&digest).await?;
            admission.settle(caller, peer, found)
        });
        lookup
            .await
            .unwrap_or(Err(Unverified::Lookup(LookupError::Unavailable)))
    }

    /// What a lookup found, remembered; a token of nobody's counted against its peer.
    fn settle(
        &self,
        caller: Caller,
        peer: Option<PeerKey>,
        found: Found,
    ) -> Result<(), Unverified> {
        match (caller, found) {
            (Caller::Token(digest), Some(user_id)) => {
                self.known_tokens.insert(&digest, user_id);
                Ok(())
            }
            _ => {
                self.unknown(caller);
                crate::metrics::refused("failed_auth");
                self.failed_auth(peer);
                Err(Unverified::UnknownToken)
            }
        }
    }

    /// Remembers that a caller's token belongs to `user_id` (the claim authenticated it).
    pub fn known(&self, caller: Caller, user_id: i64) {
        if let Caller::Token(digest) = caller {
            self.known_tokens.insert(&digest, user_id);
        }
    }

    /// Remembers that no user has this caller's token (it was never valid, or was revoked), and
    /// forgets its limits.
    pub fn unknown(&self, caller: Caller) {
        if let Caller::Token(digest) = caller {
            self.known_tokens.remove(&digest);
            self.unknown_tokens.insert(digest);
        }
        self.limiter.forget(caller);
    }

    pub fn peer_key(
        &self,
        peer: &PeerInfo,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Option<PeerKey> {
        peer.key(&self.trusted_proxies, metadata)
    }

    /// If a call's client address is shut out, for how long (a client a trusted proxy names:
    /// its proxy's connection stays open for everyone else, so the call itself is refused).
    pub fn shut_out_for(&self, key: Option<PeerKey>) -> Option<std::time::Duration> {
        match key {
            Some(PeerKey::Address(ip)) => self.penalties.shut_out_for(ip),
            _ => None,
        }
    }

    /// A call presented a valid credential: its client address, and the connection's, are never
    /// shut out for a while (`crate::penalty`).
    pub fn vouch(&self, key: Option<PeerKey>, peer: &PeerInfo) {
        if let Some(PeerKey::Address(ip)) = key {
            self.penalties.record_valid(ip);
        }
        if let Some(ip) = peer.connection_address(&self.trusted_proxies)
            && Some(PeerKey::Address(ip)) != key
        {
            self.penalties.record_valid(ip);
        }
    }

    /// A call failed authentication: it counts against its client address (never against a
    /// certificate-authenticated service, the internal credential or an unnamed proxy client).
    pub fn failed_auth(&self, key: Option<PeerKey>) {
        if let Some(PeerKey::Address(ip)) = key {
            self.penalties.record_failed_auth(ip);
        }
    }

    /// Counts a fresh card decline of `user_id`: once the user's declines across every replica
    /// reach the budget, this process refuses the caller's new keys until one leaves the window.
    pub async fn count_decline(&self, caller: Caller, user_id: i64) {
        let budget = self.limiter.decline_budget();
        match declines::budget_spent_for(&self.pool, user_id, budget).await {
            Ok(Some(frees_in)) => self.limiter.decline_budget_spent_for(caller, frees_in),
            Ok(None) => {}
            // The decline is stored: the next one counts it again.
            Err(error) => tracing::warn!(
                error = %telemetry::error_chain(&error),
                "could not count a user's recent declines"
            ),
        }
    }

    /// A place in the service's share of CreateRide concurrency; `Ok(None)` for a caller that is
    /// not a certificate-authenticated service.
    pub fn take_create_share(
        &self,
        peer: Option<PeerKey>,
    ) -> Result<Option<SharePermit>, ShareTaken> {
        match peer {
            Some(PeerKey::Service(service)) => {
                self.create_shares.take(service).map(Some).ok_or(ShareTaken)
            }
            _ => Ok(None),
        }
    }

    /// Calls waiting for a token-lookup place now.
    pub fn lookups_waiting(&self) -> usize {
        self.lookups.waiting()
    }

    /// Tokens being looked up now (the single-flight entries).
    pub fn lookups_in_flight(&self) -> usize {
        self.lookups.in_flight()
    }

    pub fn known_tokens(&self) -> usize {
        self.known_tokens.len()
    }

    /// Tokens refused from memory now (`UNKNOWN_TOKEN_CACHE_*`).
    pub fn unknown_tokens(&self) -> usize {
        self.unknown_tokens.len()
    }

    /// Callers whose rate-limit buckets are held now (`MAX_TRACKED_CALLERS`).
    pub fn tracked_callers(&self) -> usize {
        self.limiter.tracked_callers()
    }
}

/// Half the pool, at least one: lookups never take the connections that known callers' claims
/// need, and a cold burst still has several lookups running at once.
pub fn default_lookup_places(pool_size: u32) -> usize {
    usize::try_from(pool_size / 2).unwrap_or(1).max(1)
}
