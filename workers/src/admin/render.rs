//! The text form of every admin report (the JSON form is the reports' serde serialisation).

use std::fmt::Write as _;

use chrono::{DateTime, SecondsFormat, Utc};
use contract::Outcome;

use super::{
    ChangeReport, Mode,
    attention::{AttentionList, AttentionRow},
    backlog::Backlog,
    dead_letters::{DeadLetter, DeadLetterList, RequeueReport},
    keys::KeyReport,
};

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
fn relative(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    if at <= now {
        format!("{} ({} ago)", time(at), duration(now - at))
    } else {
        format!("{} (in {})", time(at), duration(at - now))
    }
}

fn optional_time(at: Option<DateTime<Utc>>, now: DateTime<Utc>, none: &str) -> String {
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
    }
}

pub fn key_report(report: &KeyReport) -> String {
    let now = report.now;
    let mut out = String::new();
    match &report.key {
        None => {
            let _ = writeln!(
                out,
                "The idempotency key no longer exists (reaped). Attention rows about it follow."
            );
        }
        Some(key) => {
            let _ = writeln!(out, "Idempotency key {}", key.id);
            let line = |out: &mut String, label: &str, value: String| {
                let _ = writeln!(out, "  {label:<16}{value}");
            };
            line(
                &mut out,
                "user",
                format!(
                    "{} ({})",
                    key.user_id,
                    key.user_email.as_deref().unwrap_or("unknown")
                ),
            );
            line(&mut out, "key", key.idempotency_key.clone());
            line(
                &mut out,
                "request",
                format!(
                    "{} {} {}",
                    key.request_method, key.request_path, key.request_params
                ),
            );
            line(&mut out, "created_at", relative(key.created_at, now));
            line(
                &mut out,
                "expires_at",
                optional_time(key.expires_at, now, "never"),
            );
            line(&mut out, "last_run_at", relative(key.last_run_at, now));
            line(&mut out, "recovery_point", key.recovery_point.to_string());
            let lock = match key.lock.locked_at {
                None => "none".to_owned(),
                Some(locked_at) => format!(
                    "held since {}, {} (expires {})",
                    relative(locked_at, now),
                    if key.lock.live {
                        "LIVE: its holder may still be running"
                    } else {
                        "expired: abandoned, may be taken over"
                    },
                    optional_time(key.lock.expires_at, now, "?")
                ),
            };
            line(&mut out, "lock", lock);
            line(
                &mut out,
                "provider key",
                format!(
                    "{} (the charge's idempotency key at the provider)",
                    key.provider_idempotency_key
                ),
            );
            line(
                &mut out,
                "completer",
                format!(
                    "{} attempt(s), next attempt {}, gave up {}",
                    key.completer.attempts,
                    optional_time(key.completer.next_attempt_at, now, "-"),
                    optional_time(key.completer.gave_up_at, now, "no")
                ),
            );
            let stored = match &key.stored_outcome {
                None => "none (unfinished)".to_owned(),
                Some(stored) => match &stored.outcome {
                    Some(decoded) => format!("code {}: {}", stored.response_code, outcome(decoded)),
                    None => format!(
                        "code {}: UNDECODABLE body {} (a replay fails with INTERNAL)",
                        stored.response_code,
                        stored
                            .undecodable
                            .as_ref()
                            .map(ToString::to_string)
                            .unwrap_or_default()
                    ),
                },
            };
            line(&mut out, "stored outcome", stored);
        }
    }
    match &report.ride {
        None if report.key.is_some() => {
            let _ = writeln!(out, "Ride: none");
        }
        None => {}
        Some(ride) => {
            let _ = writeln!(out, "Ride {}", ride.id);
            let _ = writeln!(
                out,
                "  {:<16}{}",
                "charge_id",
                ride.charge_id.as_deref().unwrap_or("none")
            );
            let _ = writeln!(out, "  {:<16}{} {}", "amount", ride.amount, ride.currency);
            let _ = writeln!(
                out,
                "  {:<16}{}",
                "created_at",
                relative(ride.created_at, now)
            );
            let receipt = match (&ride.receipt.sent_at, ride.receipt.staged_jobs) {
                (Some(sent_at), _) => format!(
                    "sent {} (message {})",
                    relative(*sent_at, now),
                    ride.receipt.sent_message_id.as_deref().unwrap_or("?")
                ),
                (None, 0) => "not staged, not sent (in flight in RabbitMQ, dead-lettered, or \
                              never staged)"
                    .to_owned(),
                (None, staged) => format!("{staged} job(s) staged, not yet published"),
            };
            let _ = writeln!(out, "  {:<16}{receipt}", "receipt");
        }
    }
    if report.attention.is_empty() {
        let _ = writeln!(out, "Keys needing attention: none");
    } else {
        let _ = writeln!(out, "Keys needing attention");
        for row in &report.attention {
            let _ = writeln!(out, "  {}", attention_line(row, now));
        }
    }
    out
}

fn attention_line(row: &AttentionRow, now: DateTime<Utc>) -> String {
    format!(
        "#{} {} recorded {} at {}; {}; key now {}; last error: {}",
        row.id,
        row.reason,
        relative(row.recorded_at, now),
        row.recovery_point,
        row.resolved_at.map_or_else(
            || "UNRESOLVED".to_owned(),
            |at| format!("resolved {}", time(at))
        ),
        row.key_recovery_point_now
            .map_or_else(|| "gone (reaped)".to_owned(), |point| point.to_string()),
        row.last_error.as_deref().unwrap_or("-")
    )
}

pub fn attention_list(list: &AttentionList) -> String {
    let now = Utc::now();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} keys_needing_attention row(s){}, showing {} (oldest first)",
        list.total,
        if list.all { "" } else { " unresolved" },
        list.rows.len()
    );
    for row in &list.rows {
        let _ = writeln!(out, "{}", attention_line(row, now));
        let _ = writeln!(
            out,
            "    key {} user {} {:?} params {}",
            row.idempotency_key_id, row.user_id, row.idempotency_key, row.request_params
        );
    }
    out
}

pub fn change_report(report: &ChangeReport) -> String {
    let mut out = String::new();
    let heading = match report.mode {
        Mode::DryRun => "DRY RUN, nothing changed",
        Mode::Apply => "APPLIED",
    };
    let _ = writeln!(out, "{} {}: {heading}", report.command, report.target);
    for warning in &report.warnings {
        let _ = writeln!(out, "WARNING: {warning}");
    }
    let _ = writeln!(
        out,
        "{}",
        match report.mode {
            Mode::DryRun => "Would change:",
            Mode::Apply => "Changed:",
        }
    );
    for change in &report.changes {
        let row = change
            .row
            .map_or_else(String::new, |row| format!("[{row}]"));
        match (change.column, &change.from) {
            (Some(column), Some(from)) => {
                let _ = writeln!(
                    out,
                    "  {} {}{row}.{column}: {from} -> {}",
                    change.action, change.table, change.to
                );
            }
            _ => {
                let _ = writeln!(
                    out,
                    "  {} {}{row}: {}",
                    change.action, change.table, change.to
                );
            }
        }
    }
    for note in &report.notes {
        let _ = writeln!(out, "Note: {note}");
    }
    if report.mode == Mode::DryRun {
        let _ = writeln!(out, "Re-run with --yes to apply.");
    }
    out
}

fn dead_letter_line(message: &DeadLetter) -> String {
    let death = message.death.as_ref().map_or_else(
        || "no x-death".to_owned(),
        |death| {
            format!(
                "{} x{} from {} at {}",
                death.reason.as_deref().unwrap_or("?"),
                death.count.unwrap_or(0),
                death.queue.as_deref().unwrap_or("?"),
                death.time.map_or_else(|| "?".to_owned(), time)
            )
        },
    );
    format!(
        "message {} job {} routing {}: {death}; {}",
        message.message_id.as_deref().unwrap_or("-"),
        message.job_name.as_deref().unwrap_or("-"),
        message.routing_key,
        message.summary
    )
}

pub fn dead_letters(list: &DeadLetterList) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} message(s), {} consumer(s); showing {} (left in the queue)",
        list.queue.queue, list.queue.messages, list.queue.consumers, list.shown
    );
    for message in &list.messages {
        let _ = writeln!(out, "  {}", dead_letter_line(message));
    }
    out
}

pub fn requeue_report(report: &RequeueReport) -> String {
    let mut out = String::new();
    match report.mode {
        Mode::DryRun => {
            let _ = writeln!(
                out,
                "dead-letters requeue: DRY RUN, nothing moved. Would move {} of {} message(s) \
                 from {} to exchange {} with routing key {}:",
                report.moved,
                report.dead_letter_depth_before,
                report.from_queue,
                report.to_exchange,
                report.routing_key
            );
        }
        Mode::Apply => {
            let _ = writeln!(
                out,
                "dead-letters requeue: APPLIED. Moved {} message(s) from {} to exchange {} with \
                 routing key {}:",
                report.moved, report.from_queue, report.to_exchange, report.routing_key
            );
        }
    }
    for message in &report.messages {
        let _ = writeln!(out, "  {}", dead_letter_line(message));
    }
    let _ = writeln!(
        out,
        "{}: {} message(s) before, {} now",
        report.from_queue, report.dead_letter_depth_before, report.dead_letter_depth_after
    );
    if let Some(stopped) = &report.stopped {
        let _ = writeln!(out, "STOPPED: {stopped}");
    }
    if report.mode == Mode::DryRun && report.moved > 0 {
        let _ = writeln!(out, "Re-run with --yes to move them.");
    }
    out
}

pub fn backlog(backlog: &Backlog) -> String {
    let now = backlog.now;
    let mut out = String::new();
    if backlog.staged_jobs.is_empty() {
        let _ = writeln!(out, "Staged jobs: none");
    } else {
        let _ = writeln!(out, "Staged jobs (not yet published)");
        for staged in &backlog.staged_jobs {
            let _ = writeln!(
                out,
                "  {:<24}{:>8} oldest {}",
                staged.job_name,
                staged.count,
                relative(staged.oldest_created_at, now)
            );
        }
    }
    if !backlog.held_jobs.is_empty() {
        let _ = writeln!(
            out,
            "Staged jobs the broker returned or refused (set_aside: retried after a back-off; \
             parked: waiting for a human)"
        );
        for held in &backlog.held_jobs {
            let _ = writeln!(
                out,
                "  {:<24}{:<10}{:>8} oldest {} (job {}, {} attempt(s)): {}",
                held.job_name,
                held.state,
                held.count,
                relative(held.oldest_created_at, now),
                held.oldest_id,
                held.max_attempts,
                held.last_error.as_deref().unwrap_or("-")
            );
        }
    }
    let _ = writeln!(out, "Queues");
    for queue in &backlog.queues {
        let _ = writeln!(
            out,
            "  {:<32}{:>8} message(s) {:>4} consumer(s)",
            queue.queue, queue.messages, queue.consumers
        );
    }
    if let Some(error) = &backlog.queues_error {
        let _ = writeln!(out, "  unavailable: {error}");
    }
    let _ = writeln!(
        out,
        "Keys needing attention (unresolved): {}",
        backlog.keys_needing_attention
    );
    out
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
