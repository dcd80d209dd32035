//! When to try again: [`RetryPolicy`], its defaults and the back-off arithmetic.
//!
//! The wait before retry `n` (the first retry is `n = 1`) is
//! `max(full_jitter(min(initial × multiplierⁿ⁻¹, max)), server's RetryInfo delay)`: a random
//! point in `[0, ceiling]`, so that clients that failed together do not come back together, but
//! never sooner than the server asked. When that wait would reach the call's deadline the call
//! stops instead of sleeping into it. The numbers are mirrored by `proto/service_config.json`
//! for callers in other languages (a test checks that they agree).

use std::time::Duration;

/// How a call retries. Every field is public; start from [`RetryPolicy::default`] and change
/// what a caller needs (the completer makes one attempt per pass, the load generator retries
/// more and without an overall deadline of its own, etc.).
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included. Default 5: gRPC's own retry support caps
    /// `maxAttempts` at 5, so the service config for other languages can say the same; with the
    /// server's 1–2 s `RetryInfo` that covers several seconds of a provider or database blip.
    /// Beyond that the key stays resumable: a later call with the same key (or the completer)
    /// finishes it. `0` is treated as 1.
    pub max_attempts: u32,
    /// Ceiling of the first back-off. Default 100 ms: a reset connection or a restarting server
    /// is usually back within that; the server's own answers carry a `RetryInfo` of 1 s or more,
    /// which wins anyway.
    pub initial_backoff: Duration,
    /// Growth of the ceiling per retry. Default 2 (doubling), as gRPC and Stripe's SDKs do.
    pub multiplier: f64,
    /// Cap of the ceiling. Default 5 s: above the longest `RetryInfo` the server sends (2 s, a
    /// provider outage), far below the deadline, so a late retry still fits in it.
    pub max_backoff: Duration,
    /// The whole call, every attempt and wait included. Default 60 s: room for one attempt that
    /// waits out the provider's timeout (`STRIPE_TIMEOUT_MS`, 30 s) and the retries after it,
    /// below the server's `GRPC_REQUEST_TIMEOUT_SECS` (120 s). A caller who waited a minute for
    /// a ride is gone; the completer finishes what they abandoned.
    pub deadline: Duration,
    /// One attempt, capped by what is left of the deadline. Default 35 s: longer than the
    /// provider timeout, so an attempt that waits on the provider gets the server's answer rather
    /// than being cut off and retried into `IDEMPOTENCY_KEY_IN_USE` (the cut attempt keeps the
    /// key's lock until it ends). Sent as `grpc-timeout` too, so the server knows.
    pub attempt_timeout: Duration,
    /// How long an attempt may wait on the server for another attempt in flight with the same
    /// key (a retry after a cut attempt, a duplicate from elsewhere) to finish, and then get its
    /// answer, as a replay, instead of `IDEMPOTENCY_KEY_IN_USE` (the `idempotency-wait`
    /// metadata). Default `None`, **waiting on**: nothing is sent and the server waits up to its
    /// `IDEMPOTENCY_WAIT_MAX_MS` (31 s by default), always ending before the attempt's timeout.
    /// `Some(d)` sends `d` in milliseconds (the server never waits longer than its own setting);
    /// `Some(Duration::ZERO)` opts out: the server answers `IDEMPOTENCY_KEY_IN_USE` at once.
    pub idempotency_wait: Option<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            multiplier: 2.0,
            max_backoff: Duration::from_secs(5),
            deadline: Duration::from_secs(60),
            attempt_timeout: Duration::from_secs(35),
            idempotency_wait: None,
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retry: for callers that retry on their own schedule (the completer's
    /// per-key back-off across passes) but want the typed errors, spans and replay marker.
    pub fn single_attempt(timeout: Duration) -> Self {
        RetryPolicy {
            max_attempts: 1,
            deadline: timeout,
            attempt_timeout: timeout,
            ..RetryPolicy::default()
        }
    }

    /// Attempts actually allowed (at least one).
    pub fn attempts(&self) -> u32 {
        self.max_attempts.max(1)
    }

    /// The jitter ceiling before retry `retry` (1 = the first retry):
    /// `min(initial × multiplier^(retry-1), max_backoff)`. Never panics: an overflowing or
    /// non-finite product (a huge retry number, a NaN multiplier) is the cap.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let exponent = i32::try_from(retry.saturating_sub(1)).unwrap_or(i32::MAX);
        let secs = self.initial_backoff.as_secs_f64() * self.multiplier.powi(exponent);
        Duration::try_from_secs_f64(secs)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }

    /// The wait before retry `retry`, or `None` when the call must stop because that wait would
    /// reach the deadline (`remaining` is what is left of it). `unit` is the jitter draw in
    /// `[0, 1]` (anything else counts as 0 or 1): the full-jitter point in `[0, ceiling]`, raised
    /// to the server's `RetryInfo` delay when it asked for longer.
    pub fn wait(
        &self,
        retry: u32,
        server_delay: Option<Duration>,
        remaining: Duration,
        unit: f64,
    ) -> Option<Duration> {
        let unit = if unit.is_nan() {
            0.0
        } else {
            unit.clamp(0.0, 1.0)
        };
        let ceiling = self.ceiling(retry);
        let jittered = Duration::try_from_secs_f64(ceiling.as_secs_f64() * unit).unwrap_or(ceiling);
        let wait = jittered.max(server_delay.unwrap_or(Duration::ZERO));
        (wait < remaining).then_some(wait)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn ceilings_double_up_to_the_cap() {
        let policy = RetryPolicy::default();
        let ms = |n| policy.ceiling(n).as_millis();
        assert_eq!(
            [ms(1), ms(2), ms(3), ms(4), ms(6), ms(7)],
            [100, 200, 400, 800, 3200, 5000]
        );
        assert_eq!(policy.ceiling(u32::MAX), policy.max_backoff);
        let nan = RetryPolicy {
            multiplier: f64::NAN,
            ..RetryPolicy::default()
        };
        assert_eq!(nan.ceiling(3), nan.max_backoff);
    }

    #[test]
    fn the_server_delay_is_a_floor_and_the_deadline_stops() {
        let policy = RetryPolicy::default();
        let long = Duration::from_secs(60);
        // No jitter drawn: the server's delay alone.
        assert_eq!(
            policy.wait(1, Some(Duration::from_secs(2)), long, 0.0),
            Some(Duration::from_secs(2))
        );
        // The whole ceiling drawn, above a shorter server delay.
        assert_eq!(
            policy.wait(6, Some(Duration::from_secs(1)), long, 1.0),
            Some(Duration::from_millis(3200))
        );
        // A wait that would reach the deadline stops the call.
        assert_eq!(
            policy.wait(1, Some(Duration::from_secs(2)), Duration::from_secs(2), 0.0),
            None
        );
        assert_eq!(policy.wait(1, None, Duration::ZERO, 0.0), None);
        assert_eq!(policy.wait(1, None, long, f64::NAN), Some(Duration::ZERO));
    }

    #[test]
    fn zero_attempts_means_one() {
        let policy = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        assert_eq!(policy.attempts(), 1);
        assert_eq!(
            RetryPolicy::single_attempt(Duration::from_secs(3)).attempts(),
            1
        );
    }

    proptest! {
        #[test]
        fn waits_stay_within_jitter_floor_and_deadline(
            retry in 1_u32..100,
            unit in -1.0_f64..2.0,
            server_ms in proptest::option::of(0_u64..10_000),
            remaining_ms in 0_u64..120_000,
            initial_ms in 0_u64..2_000,
            multiplier in 0.0_f64..10.0,
            max_ms in 0_u64..30_000,
        ) {
            let policy = RetryPolicy {
                initial_backoff: Duration::from_millis(initial_ms),
                multiplier,
                max_backoff: Duration::from_millis(max_ms),
                ..RetryPolicy::default()
            };
            let server = server_ms.map(Duration::from_millis);
            let remaining = Duration::from_millis(remaining_ms);
            let ceiling = policy.ceiling(retry);
            prop_assert!(ceiling <= policy.max_backoff);
            match policy.wait(retry, server, remaining, unit) {
                Some(wait) => {
                    prop_assert!(wait < remaining, "{wait:?} reaches the deadline");
                    prop_assert!(wait >= server.unwrap_or_default(), "{wait:?} below RetryInfo");
                    prop_assert!(wait <= ceiling.max(server.unwrap_or_default()));
                }
                None => {
                    // Stopping is only right when even the smallest allowed wait reaches it.
                    let least = if unit <= 0.0 { Duration::ZERO } else { ceiling.mul_f64(unit.min(1.0)) };
                    prop_assert!(least.max(server.unwrap_or_default()) >= remaining);
                }
            }
        }
    }
}
