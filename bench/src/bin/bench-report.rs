//! `bench-report`:
//! - `bench-report table RESULTS.jsonl`: prints the results table (Markdown) of a `bench/run.sh` run.
//! - `bench-report pgbench SCENARIO SCRIPT CLIENTS LOG LOAD_AVG [BATCH]`: reads a pgbench log and
//!   prints its ceiling as one results line (`{"kind":"pgbench",…}`; BATCH is the rides per script
//!   run of a batched script); fails if the log has no tps.

use anyhow::{Context, bail};
use serde_json::json;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["table", path] => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
            let records = bench::report::parse_records(&text).context("malformed results line")?;
            print!("{}", bench::report::render(&records));
        }
        [
            "pgbench",
            scenario,
            script,
            clients,
            log,
            load_avg,
            batch @ ..,
        ] if batch.len() <= 1 => {
            let text =
                std::fs::read_to_string(log).with_context(|| format!("cannot read {log}"))?;
            let tps = bench::parse_pgbench_tps(&text)
                .with_context(|| format!("no tps in pgbench output {log}"))?;
            let clients: u32 = clients.parse().context("CLIENTS must be a number")?;
            let batch: Option<u32> = batch
                .first()
                .map(|batch| batch.parse().context("BATCH must be a number"))
                .transpose()?;
            println!(
                "{}",
                json!({
                    "kind": "pgbench",
                    "scenario": scenario,
                    "script": script,
                    "clients": clients,
                    "tps": tps,
                    "batch": batch,
                    "latency_avg_ms": bench::parse_pgbench_latency_ms(&text),
                    "load_avg": load_avg,
                })
            );
        }
        _ => bail!(
            "usage: bench-report table RESULTS.jsonl | bench-report pgbench SCENARIO SCRIPT CLIENTS LOG LOAD_AVG [BATCH]"
        ),
    }
    Ok(())
}
