//! What every admin report's text form is made of: times, durations and outcomes as an operator
//! reads them. Each report renders itself beside its definition (`render` on the report type);
//! the JSON form is the reports' serde serialisation.

use chrono::{DateTime, SecondsFormat, Utc};
use contract::Outcome;

pub fn time(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// `1h 2m 3s`, `45s`, `0s`; negative durations print as their magnitude.
pub fn duration(duration: chrono::Duration) -> String {
    let total = duration.num_seconds().unsigned_abs();
    let (days, hours, minutes, seconds) = (
        total / 86_400,
        total % 86_400 / 3600,
        total % 3600 / 60,
        total % 60,
    );
    let mut parts = Vec::new();
    if days > 0 {
        parts.push(format!("{days}d"));
    }
    if hours > 0 {
        parts.push(format!("{hours}h"));
    }
    if minutes > 0 {
        parts.push(format!("{minutes}m"));
    }
    if seconds > 0 || parts.is_empty() {
        parts.push(format!("{seconds}s"));
    }
    parts.join(" ")
}

/// `2026-11-21T09:00:00Z (3m 2s ago)` or `(in 71h 56m)`.
pub fn relative(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    if at <= now {
        format!("{} ({} ago)", time(at), duration(now - at))
    } else {
        format!("{} (in {})", time(at), duration(at - now))
    }
}

pub fn optional_time(at: Option<DateTime<Utc>>, now: DateTime<Utc>, none: &str) -> String {
    at.map_or_else(|| none.to_owned(), |at| relative(at, now))
}

/// How a client's replay of the outcome reads.
pub fn outcome(outcome: &Outcome) -> String {
    match outcome {
        Outcome::RideCreated { ride, message } => format!(
            "OK: ride {} charge {} ({} {}) {message:?}",
            ride.id,
            ride.charge_id.as_deref().unwrap_or("none"),
            ride.amount,
            ride.currency
        ),
        Outcome::CardDeclined {
            message,
            decline_code,
        } => format!(
            "FAILED_PRECONDITION CARD_DECLINED {message:?} (decline_code {})",
            decline_code.as_deref().unwrap_or("none")
        ),
        Outcome::PaymentRefunded {
            payment_intent,
            refund_id,
            message,
            ..
        } => format!(
            "FAILED_PRECONDITION PAYMENT_REFUNDED {message:?} ({payment_intent} refunded as \
             {refund_id})"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(chrono::Duration::seconds(0)), "0s");
        assert_eq!(duration(chrono::Duration::seconds(45)), "45s");
        assert_eq!(duration(chrono::Duration::seconds(3723)), "1h 2m 3s");
        assert_eq!(duration(chrono::Duration::seconds(-120)), "2m");
        assert_eq!(duration(chrono::Duration::hours(72)), "3d");
    }
}
