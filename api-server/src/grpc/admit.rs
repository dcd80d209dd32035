//! Admission as the transport applies it to one call: who the peer is, its credential (the
//! known-token cache, else a token lookup through `crate::auth`), its CreateRide permits and
//! share, and the decline budget (whose one lookup asks `crate::idempotency` whether the key
//! exists). The rules themselves are `crate::admission`'s and `crate::limits`'.

use std::time::Duration;

use schema::models::User;
use tonic::{Request, Response, Status, metadata::MetadataMap};

use crate::{
    admission::{
        Unverified,
        lookup::LookupError,
        peer::{PeerInfo, PeerKey},
        shares::SharePermit,
    },
    auth::{self, Caller},
    idempotency::{self, IdempotencyKey},
    limits::CreatePermit,
    metrics::{self},
};

use super::*;

/// The retry hint when the token-lookup queue is full: lookups take milliseconds.
pub(super) const LOOKUP_RETRY: Duration = Duration::from_millis(200);
/// The retry hint when a service holds its share of CreateRides in flight: about one provider
/// call.
pub(super) const SHARE_RETRY: Duration = Duration::from_secs(1);

/// What an admitted CreateRide holds until its attempt ends: its user's concurrency place and, for
/// a certificate-authenticated service, a place in that service's share.
pub(super) type CreatePermits = (CreatePermit, Option<SharePermit>);

/// A caller that passed admission (its credential verified, lately or now), with its
/// CreateRide concurrency permit.
pub(super) struct Admitted<P> {
    pub(super) caller: Caller,
    pub(super) permit: P,
}

/// Where a call comes from: its connection, its client (its own address, the one a trusted proxy
/// names, or its certificate), and whom its refusals count against (that client; nobody for the
/// internal credential). Worked out once per call.
pub(super) struct CallPeer {
    pub(super) info: PeerInfo,
    pub(super) client: Option<PeerKey>,
    pub(super) key: Option<PeerKey>,
}

impl RideApi {
    pub(super) fn call_peer<T>(&self, request: &Request<T>) -> CallPeer {
        let info = request
            .extensions()
            .get::<PeerInfo>()
            .cloned()
            .unwrap_or_default();
        let metadata = request.metadata();
        let internal = bearer(metadata).is_ok_and(|token| self.is_internal(token));
        let client = self.admission.peer_key(&info, metadata);
        let key = if internal { None } else { client };
        CallPeer { info, client, key }
    }

    /// Counts a call that failed authentication against its peer; nothing else counts.
    pub(super) fn note_failed_auth<T>(
        &self,
        peer: &CallPeer,
        result: &Result<Response<T>, Status>,
    ) {
        if let Err(status) = result
            && matches!(
                status.code(),
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
            )
            && !status::is_counted_against_peer(status)
        {
            metrics::refused("failed_auth");
            self.admission.failed_auth(peer.key);
        }
    }

    pub(super) fn is_internal(&self, token: &str) -> bool {
        self.internal_api_token
            .as_ref()
            .is_some_and(|internal| auth::is_internal_token(token, internal.expose()))
    }

    /// Who is calling, as far as memory can tell: every credential check that needs no database,
    /// in the contract's order. A token that cannot be one of ours, or that was looked up lately
    /// and belongs to nobody, is refused here.
    pub(super) fn identify(&self, metadata: &MetadataMap) -> Result<Caller, Status> {
        self.caller(bearer(metadata)?, metadata)
    }

    /// The caller that presents `token`, in the contract's order of checks.
    pub(super) fn caller(&self, token: &str, metadata: &MetadataMap) -> Result<Caller, Status> {
        match (self.is_internal(token), metadata.get(ON_BEHALF_OF_HEADER)) {
            (false, None) => {
                if !auth::is_token_shaped(token) {
                    return Err(status::invalid_credentials());
                }
                let digest = auth::token_digest(token);
                if self.admission.is_unknown(&digest) {
                    return Err(status::invalid_credentials());
                }
                Ok(Caller::Token(digest))
            }
            (false, Some(_)) => Err(status::on_behalf_of_not_allowed()),
            (true, None) => Err(status::on_behalf_of_required()),
            (true, Some(user_id)) => user_id
                .to_str()
                .ok()
                .and_then(|id| id.parse::<i64>().ok())
                .map(Caller::OnBehalfOf)
                .ok_or_else(status::on_behalf_of_required),
        }
    }

    /// Admits a call: not from a client address shut out behind a trusted proxy, under its
    /// user's `limit`, and with its credential verified (from memory, or by a queued lookup).
    /// An admitted call vouches for its peer (`crate::penalty`).
    pub(super) async fn admit<P>(
        &self,
        peer: &CallPeer,
        caller: Result<Caller, Status>,
        limit: impl FnOnce(Caller) -> Result<P, Status>,
    ) -> Result<Admitted<P>, Status> {
        if let Some(cooldown) = self.admission.shut_out_for(peer.key) {
            metrics::refused("shut_out");
            return Err(status::rate_limited(
                "too many failed authentications from this address; retry later",
                cooldown,
            ));
        }
        let caller = caller?;
        let permit = limit(caller)?;
        self.admission
            .verify(caller, peer.key)
            .await
            .map_err(|unverified| match unverified {
                Unverified::ServiceShare => {
                    metrics::refused("service_share");
                    status::rate_limited(
                        "this service holds its share of the token lookups; retry later",
                        LOOKUP_RETRY,
                    )
                }
                Unverified::UnknownToken => {
                    status::counted_against_peer(status::invalid_credentials())
                }
                Unverified::Lookup(LookupError::Busy) => {
                    metrics::refused("lookup_busy");
                    status::rate_limited(
                        "too many calls with tokens not verified lately; retry later",
                        LOOKUP_RETRY,
                    )
                }
                Unverified::Lookup(LookupError::Unavailable) => status::database_unavailable(),
            })?;
        self.admission.vouch(peer.key, &peer.info);
        Ok(Admitted { caller, permit })
    }

    /// Admits a CreateRide under its user's rate and concurrency, and its service's share.
    pub(super) async fn admit_create(
        &self,
        metadata: &MetadataMap,
        peer: &CallPeer,
    ) -> Result<Admitted<CreatePermits>, Status> {
        let admission = &self.admission;
        self.admit(peer, self.identify(metadata), |caller| {
            let user = admission.limiter.admit_create(caller).map_err(|refusal| {
                metrics::refused("user_rate");
                status::rate_limited(
                    "too many CreateRide calls for this user; retry later",
                    refusal.retry_after,
                )
            })?;
            let service = admission.take_create_share(peer.key).map_err(|_| {
                metrics::refused("service_share");
                status::rate_limited(
                    "this service holds its share of the CreateRides in flight; retry later",
                    SHARE_RETRY,
                )
            })?;
            Ok((user, service))
        })
        .await
    }

    /// Admits a GetRide under its user's rate. The internal credential is for CreateRide only:
    /// the completer never reads rides.
    pub(super) async fn admit_get(
        &self,
        metadata: &MetadataMap,
        peer: &CallPeer,
    ) -> Result<Admitted<()>, Status> {
        let token = bearer(metadata);
        let caller = match token {
            Ok(token) if self.is_internal(token) => Err(status::internal_credential_not_allowed()),
            Ok(token) => self.caller(token, metadata),
            Err(status) => Err(status),
        };
        let limiter = &self.admission.limiter;
        self.admit(peer, caller, |caller| {
            limiter.admit_get(caller).map_err(|refusal| {
                metrics::refused("user_rate");
                status::rate_limited(
                    "too many GetRide calls for this user; retry later",
                    refusal.retry_after,
                )
            })
        })
        .await
    }

    /// The caller's user: the owner of a user token, or, for the internal credential, the user
    /// named in `on-behalf-of-user`.
    pub(super) async fn authenticate(&self, caller: Caller) -> Result<User, Status> {
        let user = match caller {
            Caller::Token(digest) => auth::user_by_token_digest(self.rides.pool(), &digest).await,
            Caller::OnBehalfOf(user_id) => auth::user_by_id(self.rides.pool(), user_id).await,
        }
        .map_err(status::store_error)?;
        match user {
            Some(user) => {
                self.admission.known(caller, user.id);
                Ok(user)
            }
            None => {
                self.admission.unknown(caller);
                Err(status::invalid_credentials())
            }
        }
    }

    /// Refuses a call on a user's behalf unless its key already exists for that user: the
    /// completer only resumes keys their user created, and the internal credential must never
    /// create a key (and charge) for any user id it names. Nothing is written. The claim by id
    /// never inserts either, so a key gone between this read and the claim is not created.
    pub(super) async fn check_on_behalf_of_key(
        &self,
        caller: Caller,
        key: &Result<IdempotencyKey, Status>,
    ) -> Result<(), Status> {
        let (Caller::OnBehalfOf(user_id), Ok(key)) = (caller, key) else {
            return Ok(());
        };
        let pool = self.rides.pool();
        let exists = idempotency::key_exists(pool, caller, key)
            .await
            .map_err(status::store_error)?;
        if exists {
            return Ok(());
        }
        // Credentials come first in the contract: an unknown user is that, not a new key.
        let user = auth::user_by_id(pool, user_id)
            .await
            .map_err(status::store_error)?;
        if user.is_none() {
            return Err(status::invalid_credentials());
        }
        metrics::refused("on_behalf_of_new_key");
        Err(status::internal_credential_new_key())
    }

    /// Refuses a new key of a caller whose decline budget is spent (`crate::limits`); a key that
    /// exists (a replay, or a resumption) goes on. The lookup is made only for such a caller.
    pub(super) async fn check_decline_budget(
        &self,
        caller: Caller,
        key: &Result<IdempotencyKey, Status>,
    ) -> Result<(), Status> {
        let (Some(refusal), Ok(key)) = (self.admission.limiter.decline_budget_spent(caller), key)
        else {
            return Ok(());
        };
        let exists = idempotency::key_exists(self.rides.pool(), caller, key)
            .await
            .map_err(status::store_error)?;
        if exists {
            return Ok(());
        }
        metrics::refused("decline_budget");
        Err(status::rate_limited(
            "too many declined cards lately: new idempotency keys are refused for a while",
            refusal.retry_after,
        ))
    }
}
