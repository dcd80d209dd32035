//! How long a CreateRide may wait for the attempt in flight on its key: its `idempotency-wait`
//! metadata, validated, and its deadline (`grpc-timeout`), combined with the server's settings by
//! [`crate::idempotency::wait::wait_until`].

use std::time::{Duration, Instant};

use tonic::{Status, metadata::MetadataMap};

use super::status;
use crate::idempotency::{WaitConfig, wait::wait_until};

pub use proto::metadata::IDEMPOTENCY_WAIT as IDEMPOTENCY_WAIT_HEADER;

/// The most digits `idempotency-wait` may have: as `grpc-timeout`'s value, at most 8.
const MAX_DIGITS: usize = 8;

/// The wait the caller asked for in `idempotency-wait` (milliseconds; `0`: do not wait), `None`
/// if it sent none, or the `INVALID_IDEMPOTENCY_WAIT` status.
pub fn requested_wait(metadata: &MetadataMap) -> Result<Option<Duration>, Status> {
    let Some(raw) = metadata.get(IDEMPOTENCY_WAIT_HEADER) else {
        return Ok(None);
    };
    let millis = raw
        .to_str()
        .ok()
        .filter(|raw| {
            (1..=MAX_DIGITS).contains(&raw.len()) && raw.bytes().all(|b| b.is_ascii_digit())
        })
        .and_then(|raw| raw.parse::<u64>().ok())
        .ok_or_else(|| {
            status::invalid_wait("must be a number of milliseconds from 0 to 99999999")
        })?;
    Ok(Some(Duration::from_millis(millis)))
}

/// The call's own deadline from its `grpc-timeout` (`None`: it sent none, or one tonic could not
/// read either, in which case only the server's timeout applies).
fn call_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let raw = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (value, unit) = raw.split_at_checked(raw.len().checked_sub(1)?)?;
    if value.is_empty() || value.len() > MAX_DIGITS || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: u64 = value.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value * 3600),
        "M" => Duration::from_secs(value * 60),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// Until when a call that arrived at `started` may wait, given what it asked for and its
/// deadline, the smaller of its `grpc-timeout` and the server's `request_timeout`.
pub fn wait_until_for(
    config: WaitConfig,
    metadata: &MetadataMap,
    requested: Option<Duration>,
    started: Instant,
    request_timeout: Duration,
) -> Option<Instant> {
    let deadline = call_timeout(metadata).map_or(request_timeout, |t| t.min(request_timeout));
    wait_until(config, started, requested, deadline)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(pairs: &[(&'static str, &str)]) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        for (name, value) in pairs {
            metadata.insert(*name, value.parse().unwrap());
        }
        metadata
    }

    #[test]
    fn idempotency_wait_is_milliseconds_or_refused() {
        assert_eq!(requested_wait(&metadata(&[])).unwrap(), None);
        assert_eq!(
            requested_wait(&metadata(&[(IDEMPOTENCY_WAIT_HEADER, "0")])).unwrap(),
            Some(Duration::ZERO)
        );
        assert_eq!(
            requested_wait(&metadata(&[(IDEMPOTENCY_WAIT_HEADER, "2500")])).unwrap(),
            Some(Duration::from_millis(2500))
        );
        for bad in ["", "-1", "+5", "1.5", "1s", " 5", "123456789", "true"] {
            let status =
                requested_wait(&metadata(&[(IDEMPOTENCY_WAIT_HEADER, bad)])).expect_err(bad);
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn the_call_deadline_is_read_from_grpc_timeout() {
        let timeout = |value: &str| call_timeout(&metadata(&[("grpc-timeout", value)]));
        assert_eq!(timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(timeout("5000000u"), Some(Duration::from_secs(5)));
        for bad in ["", "m", "100", "100x", "123456789m", "-1m"] {
            assert_eq!(timeout(bad), None, "{bad}");
        }
        assert_eq!(call_timeout(&metadata(&[])), None);
    }

    #[test]
    fn the_wait_follows_the_shorter_deadline() {
        let config = WaitConfig {
            max: Duration::from_secs(31),
            per_key: 8,
            per_process: 1024,
        };
        let now = Instant::now();
        let server = Duration::from_secs(120);
        let short = metadata(&[("grpc-timeout", "100m")]);
        assert_eq!(
            wait_until_for(config, &short, None, now, server),
            Some(now + Duration::from_millis(80))
        );
        assert_eq!(
            wait_until_for(config, &metadata(&[]), None, now, server),
            Some(now + config.max)
        );
        assert_eq!(
            wait_until_for(config, &metadata(&[]), None, now, Duration::from_secs(10)),
            // The margin is at most 500 ms.
            Some(now + Duration::from_millis(9500))
        );
    }
}
