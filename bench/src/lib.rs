//! Benchmark tooling for the Rocket Rides payments service.
//!
//! - `loadgen` (binary): N concurrent gRPC clients calling `CreateRide`, with fresh keys or a
//!   chosen replay ratio, retrying retryable errors with the same key; prints throughput, latency
//!   percentiles and outcome counts, samples the database's wait events and the CPU of the
//!   processes involved, then checks rides, charges, provider ledger and staged jobs against the
//!   number of successes.
//! - `bench-report` (binary): turns the JSON lines written by `bench/run.sh` (loadgen summaries,
//!   pgbench ceilings, worker drain rates) into the table of ratios to the database's ceiling.
//!
//! The pure logic (histogram, ratio math, pgbench output parsing) lives here and is unit-tested.

pub mod h2wire;
pub mod latency;
pub mod procfs;
pub mod ratio;
pub mod report;
pub mod server_counters;

/// Parses the transactions per second from pgbench's output: the line
/// `tps = 1234.567890 (without initial connection time)` (PostgreSQL 14+), or the
/// `excluding connections establishing` line of older versions. `None` when absent.
pub fn parse_pgbench_tps(output: &str) -> Option<f64> {
    let mut fallback = None;
    for line in output.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("tps = ") else {
            continue;
        };
        let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
        if rest.contains("without initial connection time")
            || rest.contains("excluding connections establishing")
        {
            return Some(value);
        }
        fallback = Some(value);
    }
    fallback
}

/// pgbench's mean latency (`latency average = 1.234 ms`), in milliseconds.
pub fn parse_pgbench_latency_ms(output: &str) -> Option<f64> {
    output.lines().find_map(|line| {
        line.trim()
            .strip_prefix("latency average = ")?
            .strip_suffix(" ms")?
            .parse()
            .ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PG15: &str = "pgbench (15.20 (Debian 15.20-0+deb12u1))\n\
        transaction type: bench/pgbench/create_ride.sql\n\
        number of clients: 32\n\
        latency average = 21.034 ms\n\
        initial connection time = 40.311 ms\n\
        tps = 1521.346213 (without initial connection time)\n";

    #[test]
    fn reads_tps_and_latency_from_pgbench_15() {
        assert_eq!(parse_pgbench_tps(PG15), Some(1521.346213));
        assert_eq!(parse_pgbench_latency_ms(PG15), Some(21.034));
    }

    #[test]
    fn prefers_the_figure_without_connection_time_in_old_output() {
        let old = "tps = 100.5 (including connections establishing)\n\
                   tps = 120.25 (excluding connections establishing)\n";
        assert_eq!(parse_pgbench_tps(old), Some(120.25));
    }

    #[test]
    fn absent_or_garbled_figures_are_none() {
        assert_eq!(
            parse_pgbench_tps("pgbench: error: connection refused"),
            None
        );
        assert_eq!(parse_pgbench_tps("tps = abc"), None);
        assert_eq!(parse_pgbench_latency_ms("latency average = x ms"), None);
    }
}
