//! One row per run: each loadgen run divided by its ceilings and judged, the median row of a
//! scenario run in rounds, and the memory rows.

use crate::ratio::{self, Goal, Verdict};

use super::*;

pub(super) fn fmt_opt(value: Option<f64>, precision: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.precision$}"))
}

/// One row of the table, already judged.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub scenario: String,
    pub clients: String,
    pub rate: f64,
    pub ceiling: Option<f64>,
    pub ratio: Option<f64>,
    /// To the scenario's pgbench run itself (for a latency scenario, before the latency bound).
    pub per_ride_ratio: Option<f64>,
    /// To the batched ceiling, for scenarios of fresh keys.
    pub batched_ratio: Option<f64>,
    pub goal: String,
    pub verdict: Verdict,
    pub latency: String,
    pub check: String,
    pub load_avg: String,
}

pub fn rows(records: &[Record]) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut runs_seen: Vec<&str> = Vec::new();
    let batched = batched_ceiling(records);
    for record in records {
        match record {
            Record::Loadgen(run) => {
                let round = runs_seen.iter().filter(|s| **s == run.scenario).count();
                runs_seen.push(&run.scenario);
                rows.push(loadgen_row(
                    run,
                    neighbour_ceiling(records, &run.scenario, round),
                    batched,
                ));
            }
            Record::Drain(drain) => {
                let rate = if drain.seconds > 0.0 {
                    drain.items as f64 / drain.seconds
                } else {
                    0.0
                };
                let (goal, verdict) = if drain.scenario == "enqueuer" {
                    (
                        format!(">= {ENQUEUER_GOAL_PER_S} jobs/s"),
                        Goal::AtLeast(ENQUEUER_GOAL_PER_S).judge(Some(rate)),
                    )
                } else {
                    ("-".to_owned(), Verdict::Unknown)
                };
                rows.push(Row {
                    scenario: drain.scenario.clone(),
                    clients: "-".to_owned(),
                    rate,
                    ceiling: None,
                    ratio: None,
                    per_ride_ratio: None,
                    batched_ratio: None,
                    goal,
                    verdict,
                    latency: format!("{} items in {:.2} s", drain.items, drain.seconds),
                    check: drain.note.clone(),
                    load_avg: drain.load_avg.clone(),
                });
            }
            Record::Pgbench(_) => {}
        }
    }
    rows.extend(median_rows(records, &rows));
    rows
}

/// The database ceiling beside the `round`-th loadgen run of `scenario`. With `bench/run.sh
/// ROUNDS=n` a scenario runs ceiling, service, ceiling, …, service, ceiling, so service run k sits
/// between ceilings k and k + 1 and is divided by their mean: on a shared machine one pgbench
/// window alone swung a ratio by ±0.15. With one round there is one ceiling, taken before.
pub(super) fn neighbour_ceiling(records: &[Record], scenario: &str, round: usize) -> Option<f64> {
    let ceilings: Vec<f64> = records
        .iter()
        .filter_map(|record| match record {
            Record::Pgbench(pg) if pg.scenario == scenario => Some(pg.rides_per_s()),
            _ => None,
        })
        .collect();
    let neighbours: Vec<f64> = ceilings.iter().skip(round).take(2).copied().collect();
    match neighbours.as_slice() {
        [] => ceilings.last().copied(),
        found => Some(found.iter().sum::<f64>() / found.len() as f64),
    }
}

/// Whether a scenario creates rides with fresh keys (so the batched ceiling bounds it). `riders-64`
/// does too, but 64 calls behind a 250 ms provider bound it far below any database ceiling.
pub(super) fn creates_rides(scenario: &str) -> bool {
    scenario.starts_with("new-") || scenario.starts_with("latency") || scenario == "riders-closed"
}

pub(super) fn loadgen_row(
    run: &LoadgenRecord,
    db_ceiling: Option<f64>,
    batched: Option<f64>,
) -> Row {
    let ceiling = db_ceiling.map(|tps| {
        ratio::latency_bound_ceiling(tps, run.clients, run.provider_latency_ms as f64 / 1000.0)
    });
    let ratios = Ratios {
        own: ceiling.and_then(|ceiling| ratio::ratio(run.throughput, ceiling)),
        per_ride: db_ceiling.and_then(|tps| ratio::ratio(run.throughput, tps)),
        batched: batched
            .filter(|_| creates_rides(&run.scenario))
            .and_then(|batched| ratio::ratio(run.throughput, batched)),
    };
    let (goal, verdict) = judge(run, ratios);
    let mut check = match run.check_pass {
        Some(true) => "PASS".to_owned(),
        Some(false) => "FAIL".to_owned(),
        None => "-".to_owned(),
    };
    if run.conflicts_surfaced > 0 || run.failed > 0 {
        check.push_str(&format!(
            " (aborted {}, failed {})",
            run.conflicts_surfaced, run.failed
        ));
    }
    if let Some(kb) = run.server_rss_peak_kb {
        check.push_str(&format!(", rss {:.1} MB", kb as f64 / 1024.0));
    }
    Row {
        scenario: run.scenario.clone(),
        clients: run.clients.to_string(),
        rate: run.throughput,
        ceiling,
        ratio: ratios.own,
        per_ride_ratio: ratios.per_ride,
        batched_ratio: ratios.batched,
        goal,
        verdict,
        latency: format!(
            "p50 {:.1} / p99 {:.1} / max {:.1} ms",
            run.p50_ms, run.p99_ms, run.max_ms
        ),
        check,
        load_avg: run.load_avg.clone(),
    }
}

/// A service rate divided by each of its ceilings.
#[derive(Clone, Copy)]
pub(super) struct Ratios {
    pub(super) own: Option<f64>,
    pub(super) per_ride: Option<f64>,
    pub(super) batched: Option<f64>,
}

/// The scenario's goal as text and the verdict on its `ratios` and the run's latency and
/// conflicts.
pub(super) fn judge(run: &LoadgenRecord, ratios: Ratios) -> (String, Verdict) {
    match goal_for(&run.scenario) {
        None => ("-".to_owned(), Verdict::Unknown),
        Some(goal) => {
            let mut text = format!("ratio {}", goal.ratio.describe());
            let mut verdicts = vec![goal.ratio.judge(ratios.own)];
            if let Some(per_ride) = goal.per_ride {
                text.push_str(&format!(", ÷ per-ride {}", per_ride.describe()));
                verdicts.push(per_ride.judge(ratios.per_ride));
            }
            if let Some(batched) = goal.batched {
                text.push_str(&format!(", ÷ batched {}", batched.describe()));
                verdicts.push(batched.judge(ratios.batched));
            }
            if let Some(p99) = goal.p99_ms {
                text.push_str(&format!(", p99 {} ms", p99.describe()));
                verdicts.push(p99.judge(Some(run.p99_ms)));
            }
            if goal.no_conflicts {
                text.push_str(", 0 conflicts");
                verdicts.push(Goal::AtMost(0.0).judge(Some(run.conflicts_surfaced as f64)));
            }
            (text, ratio::all(&verdicts))
        }
    }
}

/// One more row per scenario measured in several rounds, judged on the median ratio, the worst
/// p99 and all conflicts and failed checks of its rounds: the scenario's verdict for the run.
pub(super) fn median_rows(records: &[Record], rows: &[Row]) -> Vec<Row> {
    let mut scenarios: Vec<&str> = Vec::new();
    for record in records {
        if let Record::Loadgen(run) = record
            && !scenarios.contains(&run.scenario.as_str())
        {
            scenarios.push(&run.scenario);
        }
    }
    let mut medians = Vec::new();
    for scenario in scenarios {
        let runs: Vec<&LoadgenRecord> = records
            .iter()
            .filter_map(|record| match record {
                Record::Loadgen(run) if run.scenario == scenario => Some(run),
                _ => None,
            })
            .collect();
        if runs.len() < 2 {
            continue;
        }
        let scenario_rows: Vec<&Row> = rows.iter().filter(|row| row.scenario == scenario).collect();
        let median_of = |ratio: fn(&Row) -> Option<f64>| {
            median(
                &scenario_rows
                    .iter()
                    .filter_map(|row| ratio(row))
                    .collect::<Vec<_>>(),
            )
        };
        let ratios = Ratios {
            own: median_of(|row| row.ratio),
            per_ride: median_of(|row| row.per_ride_ratio),
            batched: median_of(|row| row.batched_ratio),
        };
        let worst = LoadgenRecord {
            p99_ms: runs.iter().map(|run| run.p99_ms).fold(0.0, f64::max),
            conflicts_surfaced: runs.iter().map(|run| run.conflicts_surfaced).sum(),
            ..runs[0].clone()
        };
        let (goal, mut verdict) = judge(&worst, ratios);
        let all_passed = runs.iter().all(|run| run.check_pass != Some(false));
        if !all_passed {
            verdict = Verdict::Missed;
        }
        medians.push(Row {
            scenario: format!("{scenario}, median of {}", runs.len()),
            clients: worst.clients.to_string(),
            rate: median(&runs.iter().map(|run| run.throughput).collect::<Vec<_>>()).unwrap_or(0.0),
            ceiling: median(
                &scenario_rows
                    .iter()
                    .filter_map(|row| row.ceiling)
                    .collect::<Vec<_>>(),
            ),
            ratio: ratios.own,
            per_ride_ratio: ratios.per_ride,
            batched_ratio: ratios.batched,
            goal,
            verdict,
            latency: format!("worst p99 {:.1} ms", worst.p99_ms),
            check: if all_passed { "PASS" } else { "FAIL" }.to_owned(),
            load_avg: "-".to_owned(),
        });
    }
    medians
}

/// The median (the mean of the middle two for an even count); `None` for no values.
pub(super) fn median(values: &[f64]) -> Option<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// The memory goal, judged from the loadgen run that sampled the server's RSS.
pub fn rss_rows(records: &[Record]) -> Vec<(String, f64, Verdict)> {
    records
        .iter()
        .filter_map(|record| match record {
            Record::Loadgen(run) => run.server_rss_peak_kb.map(|kb| {
                let mb = kb as f64 / 1024.0;
                (
                    run.scenario.clone(),
                    mb,
                    Goal::Below(RSS_GOAL_MB).judge(Some(mb)),
                )
            }),
            _ => None,
        })
        .collect()
}
