//! What a call reports besides its answer: one [`AttemptRecord`] per attempt, and the outcome of
//! a successful CreateRide ([`Created`]) with the key it used and whether it was a replay.

use std::time::Duration;

use proto::v1::{CreateRideResponse, Ride};

/// One attempt of a call.
#[derive(Clone, Debug, PartialEq)]
pub struct AttemptRecord {
    /// 1 for the first attempt.
    pub number: u32,
    /// Which of the client's endpoints it went to (0 with a single endpoint).
    pub target: usize,
    /// `OK`, or the error's `Code/REASON` label ([`crate::RidesError::label`]).
    pub outcome: String,
    /// How long the attempt took, from sending to its answer or timeout.
    pub elapsed: Duration,
    /// The server's `RetryInfo` delay, if it sent one.
    pub retry_info: Option<Duration>,
    /// How long the client waited after this attempt before the next one (`None`: there was no
    /// next one).
    pub wait: Option<Duration>,
}

/// A successful CreateRide.
#[derive(Clone, Debug, PartialEq)]
pub struct Created {
    pub ride: Ride,
    /// The server's message ("Payment accepted. …").
    pub message: String,
    /// The idempotency key every attempt sent.
    pub key: String,
    /// `idempotent-replayed: true`: the answer is the stored answer of a key finished before
    /// this call's successful attempt (by an earlier call, or by one of this call's attempts that
    /// the client gave up on while it finished).
    pub replayed: bool,
    /// `idempotency-key-expires-at` (RFC 3339), when the reaper will retire the key.
    pub expires_at: Option<String>,
    pub log: Vec<AttemptRecord>,
}

impl Created {
    pub fn attempts(&self) -> u32 {
        u32::try_from(self.log.len()).unwrap_or(u32::MAX)
    }

    /// The answer as the server sent it (for callers that compare answers byte for byte).
    pub fn response(&self) -> CreateRideResponse {
        CreateRideResponse {
            ride: Some(self.ride.clone()),
            message: self.message.clone(),
        }
    }
}

/// A successful GetRide.
#[derive(Clone, Debug, PartialEq)]
pub struct Fetched {
    pub ride: Ride,
    pub log: Vec<AttemptRecord>,
}
