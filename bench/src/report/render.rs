//! The table as text: every row, the medians, the memory and the goals.

use super::{rows::fmt_opt, *};

/// The Markdown table: service rate, ceiling, ratio, goal, verdict, latency, check, load.
pub fn render(records: &[Record]) -> String {
    let mut out = String::new();
    out.push_str(
        "| scenario | clients | rate /s | ceiling /s | ratio | ÷ per-ride | ÷ batched | goal | verdict | latency | check | load avg (1/5/15) |\n",
    );
    out.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for row in rows(records) {
        out.push_str(&format!(
            "| {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            row.scenario,
            row.clients,
            row.rate,
            fmt_opt(row.ceiling, 1),
            fmt_opt(row.ratio, 2),
            fmt_opt(row.per_ride_ratio, 2),
            fmt_opt(row.batched_ratio, 2),
            row.goal,
            row.verdict.as_str(),
            row.latency,
            row.check,
            row.load_avg,
        ));
    }
    render_ceilings(&mut out, records);
    if let Some(batched) = batched_ceiling(records) {
        out.push_str(&format!(
            "\nbatched ceiling (best of the {BATCHED_CEILING} grid): {batched:.1} rides/s\n"
        ));
    }
    if let Some(merged) = best_of_grid(records, MERGED_CEILING) {
        out.push_str(&format!(
            "\nmerged ceiling (best of the {MERGED_CEILING} grid, the service's own two \
             statements per fresh key; reported, not judged): {merged:.1} rides/s\n"
        ));
        for row in rows(records)
            .iter()
            .filter(|row| row.batched_ratio.is_some())
        {
            out.push_str(&format!(
                "{} ÷ merged ceiling: {:.2}\n",
                row.scenario,
                row.rate / merged
            ));
        }
    }
    for pair in defaults_vs_lifted(records) {
        out.push_str(&format!(
            "\n{} at the defaults ÷ every defence lifted (run back to back, round {}): throughput \
             {:.2} (goal >= {LIFTED_THROUGHPUT_GOAL}), p99 {:.2}× (goal <= {LIFTED_P99_GOAL}×), \
             {} of its requests failed: {}\n",
            pair.scenario,
            pair.round,
            pair.throughput_ratio,
            pair.p99_ratio,
            pair.failed,
            pair.verdict.as_str()
        ));
    }
    for (scenario, mb, verdict) in rss_rows(records) {
        out.push_str(&format!(
            "\napi-server peak VmRSS during {scenario}: {mb:.1} MB (goal < {RSS_GOAL_MB} MB: {})\n",
            verdict.as_str()
        ));
    }
    out
}

/// The pgbench ceilings the rows were divided by.
fn render_ceilings(out: &mut String, records: &[Record]) {
    let ceilings: Vec<&PgbenchRecord> = records
        .iter()
        .filter_map(|record| match record {
            Record::Pgbench(pg) => Some(pg),
            _ => None,
        })
        .collect();
    if !ceilings.is_empty() {
        out.push_str("\npgbench ceilings (-M prepared, same PostgreSQL, scratch database):\n\n");
        out.push_str(
            "| for scenario | script | clients | rides per statement | tps | rides /s | load avg (1/5/15) |\n",
        );
        out.push_str("| --- | --- | --- | --- | --- | --- | --- |\n");
        for pg in ceilings {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {:.1} | {:.1} | {} |\n",
                pg.scenario,
                pg.script,
                pg.clients,
                pg.batch.unwrap_or(1),
                pg.tps,
                pg.rides_per_s(),
                pg.load_avg
            ));
        }
    }
}
