//! The report's `--ha` part: each fault's outage per kind of call with its explanation when it
//! was long, and the spread of the outages over the faults of one class, as JSON and as text.

use std::time::Duration;

use serde_json::{Value, json};

use crate::{
    counters::{CallKind, Unavailability},
    outages::{self, FaultOutage},
};

use super::line;

/// Each `--ha` fault: when it healed, and what the clients saw after it, in all and per kind of
/// call; then the spread per class of fault.
pub(super) fn text_ha_faults(text: &mut String, report: &Value) {
    text.push_str(&format!(
        "-- HA faults: healed after / clients unavailable (longest stretch, begun by {} s after the fault healed, from a failed attempt to the first final answer after it): all, fresh, replay, refusal / failed attempts / keys left to the completer\n",
        crate::counters::EPISODES_START_WITHIN.as_secs()
    ));
    for event in report["ha_faults"].as_array().into_iter().flatten() {
        let by_kind = |kind: CallKind| event["by_kind"][kind.label()]["unavailable_ms"].clone();
        line(
            text,
            &format!(
                "  {:>6.1}s {}",
                event["at_secs"].as_f64().unwrap_or(0.0),
                event["fault"].as_str().unwrap_or("?")
            ),
            format!(
                "{:.1}s / {}, {}, {}, {} ms / {} / {}",
                event["healed_after_secs"].as_f64().unwrap_or(0.0),
                event["clients_unavailable_ms"],
                by_kind(CallKind::Fresh),
                by_kind(CallKind::Replay),
                by_kind(CallKind::Refusal),
                event["failed_attempts"],
                event["keys_left_to_completer"]
            ),
        );
        text_long_outage(text, event);
    }
    text.push_str("-- HA outage per class of fault and kind of call: faults, unavailable p50 / p99 / max, failed attempts\n");
    for (class, kinds) in report["ha_outage_spread"].as_object().into_iter().flatten() {
        for (kind, spread) in kinds.as_object().into_iter().flatten() {
            line(
                text,
                &format!("  {class}, {kind}"),
                format!(
                    "{} / {} / {} / {} ms / {}",
                    spread["faults"],
                    spread["p50_ms"],
                    spread["p99_ms"],
                    spread["max_ms"],
                    spread["failed_attempts"]
                ),
            );
        }
    }
}

/// Unavailability past this gets its explanation printed under its fault: the goal for fresh
/// work at p99 (`invariants::failover`).
const LONG_OUTAGE_MS: u64 = 5_000;

/// For each kind of call unavailable for longer than [`LONG_OUTAGE_MS`] after `event`: when it
/// began, how the attempts failed, and how many answers came from attempts sent before it (a
/// silent server answers neither), with the fault's wall-clock time to find it in the logs.
fn text_long_outage(text: &mut String, event: &Value) {
    for kind in CallKind::ALL {
        let u = &event["by_kind"][kind.label()];
        if u["unavailable_ms"].as_u64().unwrap_or(0) <= LONG_OUTAGE_MS {
            continue;
        }
        text.push_str(&format!(
            "      {}: fault at unix {}, first failure {} ms after it; failed {}; {} answers to attempts sent before; primary's busy sessions over {} samples {}; the campaign's runtime late by up to {} ms\n",
            kind.label(),
            event["at_unix_secs"],
            u["first_failure_after_ms"],
            u["failures"],
            u["answered_from_before"],
            u["db_samples"],
            u["db_busy"],
            u["campaign_late_ms"]
        ));
    }
}

/// Each `--ha` fault with what the clients saw after it (`outages::per_fault`).
pub(super) fn ha_faults(rows: &[FaultOutage]) -> Value {
    let unavailability = |u: &Unavailability| {
        json!({
            "unavailable_ms": u.unavailable.as_millis() as u64,
            "failed_attempts": u.failed_attempts,
            "attempts": u.attempts,
            "first_failure_after_ms": u.first_failure_after.as_millis() as u64,
            "failures": u.failures,
            "answered_from_before": u.answered_from_before,
            "db_busy": u.db_busy,
            "db_samples": u.db_samples,
            "campaign_late_ms": u.own_lateness.as_millis() as u64,
        })
    };
    let rows: Vec<Value> = rows
        .iter()
        .map(|row| {
            let by_kind: serde_json::Map<String, Value> = row
                .outage
                .by_kind
                .iter()
                .map(|(kind, u)| (kind.label().to_owned(), unavailability(u)))
                .collect();
            json!({
                "fault": row.event.label,
                "class": row.class.label(),
                "at_secs": round1(row.at.as_secs_f64()),
                "at_unix_secs": row
                    .event
                    .at_wall
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| round1(d.as_secs_f64())),
                "healed_after_secs": round1((row.event.healed - row.event.at).as_secs_f64()),
                "clients_unavailable_ms": row.outage.all.unavailable.as_millis() as u64,
                "failed_attempts": row.outage.all.failed_attempts,
                "keys_left_to_completer": row.outage.keys_left,
                "by_kind": by_kind,
            })
        })
        .collect();
    json!(rows)
}

/// The spread of the outage per class of fault and kind of call (`outages::spread`).
pub(super) fn ha_outage_spread(rows: &[FaultOutage]) -> Value {
    let ms = |d: Duration| d.as_millis() as u64;
    let classes: serde_json::Map<String, Value> = outages::spread(rows)
        .into_iter()
        .map(|(class, kinds)| {
            let kinds: serde_json::Map<String, Value> = kinds
                .into_iter()
                .map(|(kind, s)| {
                    let spread = json!({
                        "faults": s.faults,
                        "p50_ms": ms(s.p50),
                        "p99_ms": ms(s.p99),
                        "max_ms": ms(s.max),
                        "failed_attempts": s.failed_attempts,
                    });
                    (kind.label().to_owned(), spread)
                })
                .collect();
            (class.label().to_owned(), Value::Object(kinds))
        })
        .collect();
    Value::Object(classes)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
