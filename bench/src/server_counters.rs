//! What the server side did during a measured window, from counters read at its start and end:
//! how full each batched statement ran (the api-server's `rides.idempotency.batch.size`
//! histogram, from its Prometheus endpoint) and how many transactions the database committed
//! (`pg_stat_database.xact_commit`). Divided by the window's requests they give the batch fill
//! per statement and the commits per ride, which explain a throughput figure.

use std::collections::BTreeMap;

/// The Prometheus name of the batch-size histogram (`rides.idempotency.batch.size`).
const BATCH_SIZE: &str = "rides_idempotency_batch_size";
/// Its statement label (`rides.batch.statement`).
const STATEMENT_LABEL: &str = "rides_batch_statement";

/// Per batched statement: requests decided (the histogram's sum) and statements run (its count).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchTotals {
    pub items: f64,
    pub statements: f64,
}

/// The batch-size totals per statement in a Prometheus text exposition. Statements the server has
/// not run yet are absent (the exporter writes no series before the first record).
pub fn batch_totals(exposition: &str) -> BTreeMap<String, BatchTotals> {
    let mut totals: BTreeMap<String, BatchTotals> = BTreeMap::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix(BATCH_SIZE) else {
            continue;
        };
        // The unit may be appended to the name by the exporter (`…_size_request_sum`).
        let Some((name, rest)) = rest.split_once('{') else {
            continue;
        };
        let is_sum = name.ends_with("_sum");
        if !is_sum && !name.ends_with("_count") {
            continue;
        }
        let Some((labels, value)) = rest.split_once('}') else {
            continue;
        };
        let Some(statement) = label(labels, STATEMENT_LABEL) else {
            continue;
        };
        let Some(value) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        let entry = totals.entry(statement.to_owned()).or_default();
        if is_sum {
            entry.items += value;
        } else {
            entry.statements += value;
        }
    }
    totals
}

/// The value of `name` in a Prometheus label set (`a="x",b="y"`).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key.trim() == name).then(|| value.trim().trim_matches('"'))
    })
}

/// Mean requests per statement, per batched statement, between two readings.
pub fn batch_fill(
    before: &BTreeMap<String, BatchTotals>,
    after: &BTreeMap<String, BatchTotals>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .filter_map(|(statement, end)| {
            let start = before.get(statement).copied().unwrap_or_default();
            let statements = end.statements - start.statements;
            (statements > 0.0).then(|| (statement.clone(), (end.items - start.items) / statements))
        })
        .collect()
}

/// The Prometheus name of the claim statements counter (`rides.idempotency.claim_statements`).
pub const CLAIM_STATEMENTS: &str = "rides_idempotency_claim_statements_total";
/// The Prometheus name of the waiters' key reads (`rides.idempotency.wait_polls`).
pub const WAIT_POLLS: &str = "rides_idempotency_wait_polls_total";

/// The counter `name` summed over every label set; `None` while the server has not counted it
/// (the exporter writes no series before the first add).
pub fn counter_total(exposition: &str, name: &str) -> Option<f64> {
    exposition
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            // `name{labels} value` or `name value`, not a longer name sharing the prefix.
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once('}')?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .reduce(|sum, value| sum + value)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# HELP rides_idempotency_batch_size Requests decided by one batched statement
# TYPE rides_idempotency_batch_size histogram
rides_idempotency_batch_size_bucket{rides_batch_statement="claim",otel_scope_name="api-server",le="1"} 10
rides_idempotency_batch_size_sum{rides_batch_statement="claim",otel_scope_name="api-server"} 40
rides_idempotency_batch_size_count{rides_batch_statement="claim",otel_scope_name="api-server"} 20
rides_idempotency_batch_size_sum{otel_scope_name="api-server",rides_batch_statement="record_charge"} 5
rides_idempotency_batch_size_count{otel_scope_name="api-server",rides_batch_statement="record_charge"} 5
rides_db_serialization_retries_total{otel_scope_name="api-server"} 3
"#;

    #[test]
    fn reads_the_sum_and_count_of_each_statement_whatever_the_label_order() {
        let totals = batch_totals(BEFORE);
        assert_eq!(
            totals["claim"],
            BatchTotals {
                items: 40.0,
                statements: 20.0
            }
        );
        assert_eq!(
            totals["record_charge"],
            BatchTotals {
                items: 5.0,
                statements: 5.0
            }
        );
        assert_eq!(totals.len(), 2);
    }

    #[test]
    fn the_fill_is_the_window_s_requests_over_its_statements() {
        let after = BEFORE
            .replace("} 40", "} 340")
            .replace("} 20\n", "} 70\n")
            .replace(
                "rides_db_serialization",
                "rides_idempotency_batch_size_sum{rides_batch_statement=\"record_charge\"} 8\n\
                 rides_idempotency_batch_size_count{rides_batch_statement=\"record_charge\"} 2\n\
                 rides_db_serialization",
            );
        let fill = batch_fill(&batch_totals(BEFORE), &batch_totals(&after));
        // claim: (340 - 40) / (70 - 20) = 6; record_charge appeared during the window: 8 / 2;
        // stage_receipt ran no statement in the window and has no fill.
        assert_eq!(fill["claim"], 6.0);
        assert_eq!(fill["record_charge"], 4.0);
        assert!(!fill.contains_key("stage_receipt"));
    }

    #[test]
    fn a_counter_is_summed_over_its_label_sets() {
        let text = "rides_idempotency_claim_statements_total{step=\"lock\"} 3\n\
                    rides_idempotency_claim_statements_total{step=\"insert_or_read\"} 7\n\
                    rides_idempotency_claim_statements_totalx 100\n\
                    rides_idempotency_wait_polls_total 4\n";
        assert_eq!(counter_total(text, CLAIM_STATEMENTS), Some(10.0));
        assert_eq!(counter_total(text, WAIT_POLLS), Some(4.0));
        assert_eq!(counter_total(BEFORE, CLAIM_STATEMENTS), None);
    }
}
