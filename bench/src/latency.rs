//! Latency recording: an HdrHistogram in microseconds, 3 significant figures, from 1 µs to one
//! hour (longer values are clamped, so a stuck request still shows up as the maximum).

use hdrhistogram::Histogram;
use serde::Serialize;
use std::time::Duration;

const MAX_MICROS: u64 = 3_600_000_000;

#[derive(Clone, Debug)]
pub struct Latencies {
    histogram: Histogram<u64>,
}

/// The percentiles the report prints, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies::new()
    }
}

impl Latencies {
    pub fn new() -> Latencies {
        // 1 µs .. 1 h at 3 significant figures is a valid configuration, so this cannot fail;
        // fall back to an auto-resizing histogram rather than panic all the same.
        let histogram = Histogram::new_with_bounds(1, MAX_MICROS, 3)
            .or_else(|_| Histogram::new(3))
            .unwrap_or_else(|_| unreachable_histogram());
        Latencies { histogram }
    }

    pub fn record(&mut self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros())
            .unwrap_or(MAX_MICROS)
            .clamp(1, MAX_MICROS);
        self.histogram.saturating_record(micros);
    }

    /// Adds every value recorded in `other` (one histogram per client, merged at the end).
    pub fn merge(&mut self, other: &Latencies) {
        // Same bounds on both sides, so this cannot fail.
        let _ = self.histogram.add(&other.histogram);
    }

    pub fn count(&self) -> u64 {
        self.histogram.len()
    }

    pub fn percentiles(&self) -> Percentiles {
        if self.histogram.is_empty() {
            return Percentiles::default();
        }
        let ms = |micros: u64| micros as f64 / 1000.0;
        Percentiles {
            count: self.histogram.len(),
            p50_ms: ms(self.histogram.value_at_quantile(0.50)),
            p90_ms: ms(self.histogram.value_at_quantile(0.90)),
            p99_ms: ms(self.histogram.value_at_quantile(0.99)),
            max_ms: ms(self.histogram.max()),
            mean_ms: self.histogram.mean() / 1000.0,
        }
    }
}

#[allow(clippy::panic)]
fn unreachable_histogram() -> Histogram<u64> {
    panic!("an HdrHistogram with 3 significant figures is always constructible")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(actual: f64, expected: f64) -> bool {
        // HdrHistogram at 3 significant figures: within 0.1 %.
        (actual - expected).abs() <= expected * 0.001 + 0.001
    }

    #[test]
    fn percentiles_of_a_uniform_spread() {
        let mut latencies = Latencies::new();
        for ms in 1..=100 {
            latencies.record(Duration::from_millis(ms));
        }
        let p = latencies.percentiles();
        assert_eq!(p.count, 100);
        assert!(close(p.p50_ms, 50.0), "{p:?}");
        assert!(close(p.p90_ms, 90.0), "{p:?}");
        assert!(close(p.p99_ms, 99.0), "{p:?}");
        assert!(close(p.max_ms, 100.0), "{p:?}");
        assert!(close(p.mean_ms, 50.5), "{p:?}");
    }

    #[test]
    fn merging_keeps_every_value_and_the_outlier() {
        let mut a = Latencies::new();
        let mut b = Latencies::new();
        for _ in 0..99 {
            a.record(Duration::from_millis(2));
        }
        b.record(Duration::from_secs(3));
        a.merge(&b);
        let p = a.percentiles();
        assert_eq!(p.count, 100);
        assert!(close(p.p99_ms, 2.0), "{p:?}");
        assert!(close(p.max_ms, 3000.0), "{p:?}");
    }

    #[test]
    fn empty_and_out_of_range_values() {
        assert_eq!(Latencies::new().percentiles(), Percentiles::default());
        let mut latencies = Latencies::new();
        latencies.record(Duration::ZERO);
        latencies.record(Duration::from_secs(10 * 3600));
        let p = latencies.percentiles();
        assert_eq!(p.count, 2);
        assert!(close(p.max_ms, 3_600_000.0), "{p:?}");
    }
}
