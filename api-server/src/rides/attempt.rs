//! One CreateRide attempt, in two steps. [`Rides::begin`] is the read a claim that reads first
//! starts with ([`idempotency::read_claim`]): it writes nothing, so it runs in the caller's own
//! request, where a hang-up may cut it short, and a replay or a mismatch (most resent keys) is
//! answered there. Everything else is a [`RideAttempt`], which [`Rides::create_ride`] runs to
//! its end: its claim writes, and a phase or a charge must not be cut in half, so the transport
//! runs it detached from the request (`crate::grpc`).

use std::{net::IpAddr, time::Instant};

use schema::models::Ride;

use super::{CreateRideReply, FirstRide, RideParams, RideRequest, Rides};
use crate::{
    auth::Caller,
    fault::CrashPoint,
    idempotency::{
        self, Attempt, ClaimRead, ClaimStart, Decision, IdempotencyKey, KeyToTake,
        RequestSignature, UserClaimed, WaitBudget, WaitEnd,
    },
};

/// What [`Rides::begin`] came to.
#[derive(Debug)]
pub enum Begun {
    /// The read decided the call: a replay or a mismatch, with the caller's user id; or the read
    /// failed (no user id then), which left nothing to undo.
    Answered(Option<i64>, CreateRideReply),
    /// The call needs an attempt that may write: run it with [`Rides::create_ride`].
    Attempt(RideAttempt),
}

/// A CreateRide attempt that may write, with what its read found.
#[derive(Debug)]
pub struct RideAttempt {
    caller: Caller,
    key: IdempotencyKey,
    params: RideParams,
    origin_ip: IpAddr,
    signature: RequestSignature,
    first_ride: FirstRide,
    attempt: Attempt,
    start: Start,
}

/// Where a [`RideAttempt`] starts, by what its read found.
#[derive(Debug)]
enum Start {
    /// With its claim's statement: there was no read, or it found no key.
    Claim,
    /// With the key the read found and the attempt may take: the locking inspection.
    Take(Box<KeyToTake>),
    /// With the read's decision: a key in use, waited for.
    InUse(Box<UserClaimed<Ride>>),
}

impl Rides {
    /// Starts a CreateRide attempt: a claim that reads first ([`Attempt::reads_first`];
    /// `resent`: the caller says it sent this key before) sends its read here, and a replay or
    /// a mismatch is answered from it. Cancel-safe: nothing it does is written.
    pub async fn begin(
        &self,
        caller: Caller,
        key: &IdempotencyKey,
        resent: bool,
        params: RideParams,
        origin_ip: IpAddr,
    ) -> Begun {
        // This attempt's lock token, from its first statement on: a statement of it whose commit
        // was lost left the key locked by it, which only this attempt can recognise or undo.
        let attempt = Attempt {
            token: uuid::Uuid::new_v4(),
            expects_key: resent,
        };
        let (signature, first_ride) = (params.signature(), self.first_ride(params, origin_ip));
        let (attempt, start) = if attempt.reads_first(caller) {
            let read = idempotency::read_claim(
                &self.claims,
                caller,
                key,
                &signature,
                &first_ride,
                &self.locking,
                attempt,
            );
            match read.await {
                Ok(ClaimRead::Decided((user, claimed)))
                    if matches!(claimed.decision, Decision::InUse) =>
                {
                    (attempt, Start::InUse(Box::new((user, claimed))))
                }
                Ok(ClaimRead::Decided(claimed)) => {
                    let (user_id, reply) = self
                        .answer_caller(claimed, key, params, origin_ip, false)
                        .await;
                    return Begun::Answered(user_id, reply);
                }
                Ok(ClaimRead::MayTake(found)) => (attempt, Start::Take(found)),
                // The claim goes straight to its write statement.
                Ok(ClaimRead::NotFound) => {
                    let write_first = Attempt {
                        expects_key: false,
                        ..attempt
                    };
                    (write_first, Start::Claim)
                }
                Err(error) => return Begun::Answered(None, Self::failed(error)),
            }
        } else {
            (attempt, Start::Claim)
        };
        // Built only for a call that needs an attempt: a replay answered here clones nothing.
        Begun::Attempt(RideAttempt {
            caller,
            key: key.clone(),
            params,
            origin_ip,
            signature,
            first_ride,
            attempt,
            start,
        })
    }

    /// Runs a CreateRide attempt to a final outcome or an error, claiming the key first (or
    /// starting from what its read decided); the claim's own statement authenticates the caller
    /// (one round trip for a new key). A key in use by a live attempt is waited for within
    /// `wait` ([`idempotency::wait`]). `None` if the caller is no user; nothing is written then.
    /// Otherwise the reply, with the caller's user id unless the claim failed before it was
    /// known. On any error that leaves the key unfinished the key is unlocked, so a retry resumes
    /// at once.
    pub async fn create_ride(
        &self,
        ride_attempt: RideAttempt,
        wait: &WaitBudget,
    ) -> Option<(Option<i64>, CreateRideReply)> {
        let RideAttempt {
            caller,
            key,
            params,
            origin_ip,
            signature,
            first_ride,
            attempt,
            start,
        } = ride_attempt;
        let key = &key;
        // Taken before the first statement that may lock, so no later than the expiry of a lock
        // it takes.
        let claim_lock_expires = Instant::now() + self.idempotency.lock_timeout;
        let (signature, first_ride) = (&signature, &first_ride);
        let claim = |start: ClaimStart| async move {
            // The claim of a fresh key commits phase `started` (its ride) with the key.
            crate::fault::crash_point(CrashPoint::StartedBeforeCommit);
            idempotency::claim(
                &self.claims,
                caller,
                key,
                signature,
                first_ride,
                &self.locking,
                start,
            )
            .await
        };
        let mut claimed = match start {
            Start::Claim => claim(attempt.into()).await,
            Start::Take(found) => claim(ClaimStart::Found(found)).await,
            Start::InUse(read) => Ok(Some(*read)),
        };
        // A key in use is waited for: its holder's outcome is answered as a replay; a key let go
        // is claimed again, and what that claim decides is the answer.
        let mut waited = false;
        while let Ok(Some((user, found))) = &mut claimed
            && matches!(found.decision, Decision::InUse)
        {
            match self
                .waits
                .wait(&self.pool, user.id, key, self.locking.rule, wait)
                .await
            {
                WaitEnd::Finished(stored) => found.decision = Decision::Replay(stored),
                WaitEnd::Free => {
                    // The key exists: it was in use.
                    let again = Attempt {
                        expects_key: true,
                        ..attempt
                    };
                    claimed = claim(again.into()).await;
                    continue;
                }
                WaitEnd::Over { waited: over } => waited = over,
            }
            break;
        }
        match claimed {
            Ok(None) => None,
            Ok(Some(claimed)) => Some(
                self.answer_caller(claimed, key, params, origin_ip, waited)
                    .await,
            ),
            Err(error) => {
                let unlock = idempotency::Unlock::Claim {
                    caller,
                    key: key.clone(),
                    token: attempt.token,
                };
                Some((None, self.claim_failed(error, unlock, claim_lock_expires)))
            }
        }
    }

    /// [`Rides::answer`] to the caller a claim authenticated, with its user id.
    async fn answer_caller(
        &self,
        (user, claimed): UserClaimed<Ride>,
        key: &IdempotencyKey,
        params: RideParams,
        origin_ip: IpAddr,
        waited: bool,
    ) -> (Option<i64>, CreateRideReply) {
        let user_id = user.id;
        let request = RideRequest {
            user,
            params,
            origin_ip,
        };
        (
            Some(user_id),
            self.answer(claimed, key, &request, waited).await,
        )
    }
}
