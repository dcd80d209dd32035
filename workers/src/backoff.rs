//! Exponential back-off with jitter, for reconnecting and for idle polling.

use std::time::Duration;

use rand::Rng;

#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max: max.max(base),
            attempt: 0,
        }
    }

    /// The next delay: `base * 2^attempt`, capped, with up to 25 % jitter subtracted so that a
    /// fleet restarted together does not reconnect in lock-step.
    pub fn next_delay(&mut self) -> Duration {
        let delay = exponential(self.base, self.attempt, self.max);
        self.attempt = self.attempt.saturating_add(1);
        let jitter = rand::rng().random_range(0.0..0.25);
        delay.mul_f64(1.0 - jitter)
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// `base * 2^exponent`, capped at `max`, without overflow.
pub fn exponential(base: Duration, exponent: u32, max: Duration) -> Duration {
    let factor = 2_u32.checked_pow(exponent.min(31)).unwrap_or(u32::MAX);
    base.checked_mul(factor).unwrap_or(max).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_and_caps() {
        let base = Duration::from_secs(60);
        let max = Duration::from_secs(3600);
        assert_eq!(exponential(base, 0, max), Duration::from_secs(60));
        assert_eq!(exponential(base, 1, max), Duration::from_secs(120));
        assert_eq!(exponential(base, 5, max), Duration::from_secs(1920));
        assert_eq!(exponential(base, 6, max), max);
        assert_eq!(exponential(base, 200, max), max);
    }
}
