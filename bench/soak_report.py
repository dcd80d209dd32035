#!/usr/bin/env python3
"""The soak's report (bench/soak.sh): one row per window, the goals judged, a chart per series.

    soak_report.py OUT_DIR [--charts DIR] [--no-drift-goals]

Reads what bench/soak.sh left in OUT_DIR: windows.jsonl (loadgen's figures per window),
samples.jsonl (the sampler's processes, database and in-memory tables), final.json (the database
once drained), reconciler-final.json (the last reconciler pass) and settings.json. Prints
Markdown; exits 0 when every goal is met, 1 when one is missed, 2 when the inputs are unusable.

Goals (issue 32): every legitimate call answered OK (the clients retry as rides-client does);
p99 and every service process's RSS in the last full window within 10 % of the first full
window's (the drift goals; RSS gets 2 MB of slack for allocator noise on a small process);
idempotency_keys (table and indexes) in the last full window within 10 % of the first full
window after the key TTL has passed once (the reaper keeps up), and the staged-job backlog never
older than 60 s; at the end, 0 unfinished keys, 0 staged jobs, 0 keys needing attention, every
ride charged once, receipted once and mailed, and 0 reconciliation findings.
"""

import argparse
import json
import os
import sys

TICKS_PER_SEC = os.sysconf("SC_CLK_TCK")
SERVICE_PROCS = ["api-server", "enqueuer", "receipts", "completer", "reaper", "reconciler"]
# The outside world's stand-ins and the database: reported, not judged (fake-stripe keeps every
# PaymentIntent in memory, as the provider's ledger; PostgreSQL's RSS is its shared buffers filling).
OTHER_PROCS = ["postgres", "fake-stripe", "mail-sink"]
CACHES = [
    "rides_admission_known_tokens",
    "rides_admission_unknown_tokens",
    "rides_limits_tracked_callers",
    "rides_admission_lookup_queue",
    "db_client_connection_count",
]
BOUNDED_TABLES = ["idempotency_keys"]
GROWING_TABLES = ["rides", "sent_receipts", "audit_records", "users"]
DRIFT = 0.10
RSS_SLACK_KB = 2048
BACKLOG_AGE_GOAL_S = 60.0


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def read_json(path, default=None):
    try:
        with open(path) as f:
            text = f.read().strip()
        return json.loads(text.splitlines()[-1]) if text else default
    except (OSError, ValueError, IndexError):
        return default


def samples_in(samples, window):
    return [s for s in samples if window["start_unix"] <= s["t"] <= window["end_unix"]]


def sample_at(samples, t):
    """The last sample at or before t (else the first)."""
    before = [s for s in samples if s["t"] <= t]
    return before[-1] if before else (samples[0] if samples else None)


def memory_kb(proc, name):
    """RSS, except PostgreSQL's: the PSS of its processes, which share its buffers."""
    if name == "postgres":
        return proc.get("pss_kb", proc["rss_kb"])
    return proc["rss_kb"]


def cpu_ticks(sample, name):
    """A process's CPU ticks; PostgreSQL's include its exited backends' (reaped by the postmaster)."""
    ticks = sample["procs"][name]["cpu_ticks"]
    if name == "postgres":
        ticks += sample["procs"].get("postgres-exited", {}).get("cpu_ticks", 0)
    return ticks


def table_bytes(sample, table):
    t = (((sample or {}).get("db") or {}).get("tables") or {}).get(table) or {}
    return t.get("table_bytes", 0) + t.get("index_bytes", 0)


def window_row(window, samples):
    inside = samples_in(samples, window)
    end = sample_at(samples, window["end_unix"])
    start = sample_at(samples, window["start_unix"])
    row = {
        "window": window["window"],
        "full": window["full"],
        "secs": window["secs"],
        "rides_per_s": window["rides_per_s"],
        "p50_ms": window["latency_ms"]["p50_ms"],
        "p99_ms": window["latency_ms"]["p99_ms"],
        "failed": window["failed"],
        "errors": {k: v for k, v in window["attempts"].items() if not k.startswith("OK")},
        "rss_mb": {},
        "cpu_cores": {},
        "tables_mb": {},
        "dead": {},
        "backlog_age_s": max(
            [((s.get("db") or {}).get("staged_oldest_age_s") or 0) for s in inside] or [0]
        ),
        "caches": dict((end or {}).get("caches") or {}),
    }
    for name in SERVICE_PROCS + OTHER_PROCS:
        if end and name in end["procs"]:
            row["rss_mb"][name] = memory_kb(end["procs"][name], name) / 1024
        if start and end and name in end["procs"] and end["t"] > start["t"]:
            ticks = cpu_ticks(end, name) - cpu_ticks(start, name)
            row["cpu_cores"][name] = ticks / TICKS_PER_SEC / (end["t"] - start["t"])
    tables = (((end or {}).get("db") or {}).get("tables")) or {}
    for name, t in tables.items():
        row["tables_mb"][name] = (t["table_bytes"] + t["index_bytes"]) / 1e6
        row["dead"][name] = t["dead"]
    return row


def judge(rows, samples, final, reconciler, loadgen, key_ttl_s, drift_goals):
    """Every goal as (name, met, what was seen)."""
    goals = []
    full = [r for r in rows if r["full"]]
    # The whole run's count: a call still in flight when its window closed is in it too.
    failed = (loadgen or {}).get("failed", sum(r["failed"] for r in rows))
    goals.append(("every call answered OK", failed == 0, f"{failed} failed after retries"))
    if drift_goals:
        if len(full) < 2:
            goals.append(("two full windows to compare", False, f"{len(full)} full window(s)"))
        else:
            first, last = full[0], full[-1]
            goals.append((
                "p99 of the last full window within 10 % of the first",
                last["p99_ms"] <= first["p99_ms"] * (1 + DRIFT),
                f"{first['p99_ms']:.1f} -> {last['p99_ms']:.1f} ms",
            ))
            for name in SERVICE_PROCS:
                a, b = first["rss_mb"].get(name), last["rss_mb"].get(name)
                if a is None or b is None:
                    continue
                goals.append((
                    f"RSS of {name}: last full window within 10 % (+2 MB) of the first",
                    b * 1024 <= a * 1024 * (1 + DRIFT) + RSS_SLACK_KB,
                    f"{a:.1f} -> {b:.1f} MB",
                ))
    # Bounded tables: compared from the first window that starts after the TTL has passed once.
    if samples:
        t0 = samples[0]["t"]
        settled = [r for r in full if r["start_unix"] >= t0 + key_ttl_s]
        if len(settled) >= 2:
            for table in BOUNDED_TABLES:
                a = table_bytes(sample_at(samples, settled[0]["end_unix"]), table)
                b = table_bytes(sample_at(samples, settled[-1]["end_unix"]), table)
                goals.append((
                    f"{table} bounded (the reaper keeps up): within 10 % once the TTL has passed",
                    b <= a * (1 + DRIFT),
                    f"{a / 1e6:.1f} -> {b / 1e6:.1f} MB",
                ))
        elif drift_goals:
            goals.append((
                "two full windows after the key TTL, to judge the reaper",
                False,
                f"{len(settled)} such window(s)",
            ))
    worst_backlog = max([r["backlog_age_s"] for r in rows] or [0])
    goals.append((
        f"staged-job backlog never older than {BACKLOG_AGE_GOAL_S:.0f} s",
        worst_backlog <= BACKLOG_AGE_GOAL_S,
        f"oldest seen {worst_backlog:.1f} s",
    ))
    if final is None:
        goals.append(("the drained database was read", False, "final.json missing"))
        return goals
    zero = ["unfinished_keys", "staged_jobs", "attention_open", "rides_uncharged",
            "charges_on_two_rides", "rides_without_receipt", "findings"]
    for name in zero:
        goals.append((f"at the end: {name} = 0", final[name] == 0, str(final[name])))
    goals.append((
        "one receipt recorded and one mail per ride",
        final["receipts_sent"] == final["rides"] == final["mail_files"],
        f"rides {final['rides']}, receipts {final['receipts_sent']}, mails {final['mail_files']}",
    ))
    goals.append((
        "the final reconciler pass ran",
        reconciler is not None,
        json.dumps(reconciler) if reconciler else "no summary",
    ))
    return goals


def fmt_map(values, digits=1):
    return ", ".join(f"{k} {v:.{digits}f}" for k, v in values.items()) or "-"


def print_report(out, rows, goals, final, settings, loadgen):
    print(f"# Soak {os.path.basename(os.path.normpath(out))}\n")
    if settings:
        print(f"PostgreSQL {settings.get('server_version')}, autovacuum {settings.get('autovacuum')}.")
    if loadgen:
        print(
            f"Traffic: {loadgen.get('clients')} calls in flight over {loadgen.get('connections')} "
            f"connection(s), {loadgen.get('users')} riders; whole run "
            f"{loadgen.get('throughput') or 0:.1f} rides/s, {loadgen.get('successes')} rides measured "
            f"(after the warm-up), "
            f"{loadgen.get('failed')} calls failed after retries.\n"
        )
    print("| window | rides/s | p50 ms | p99 ms | failed | answers not OK (attempts) | RSS MB (postgres: PSS) | CPU cores | backlog age s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mark = "" if r["full"] else " (partial)"
        print(
            f"| {r['window']}{mark} | {r['rides_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
            f"| {r['failed']} | {fmt_map(r['errors'], 0)} | {fmt_map(r['rss_mb'])} "
            f"| {fmt_map(r['cpu_cores'], 2)} | {r['backlog_age_s']:.1f} |"
        )
    print("\n| window | tables + indexes MB | dead tuples | in-memory tables (api-server) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        shown = {k: v for k, v in r["tables_mb"].items() if v >= 0.05}
        dead = {k: v for k, v in r["dead"].items() if v}
        print(f"| {r['window']} | {fmt_map(shown)} | {fmt_map(dead, 0)} | {fmt_map(r['caches'], 0)} |")
    if final:
        print(f"\nAt the end: {json.dumps(final)}")
    print("\n| goal | met | seen |")
    print("| --- | --- | --- |")
    for name, met, seen in goals:
        print(f"| {name} | {'yes' if met else '**NO**'} | {seen} |")
    missed = [g for g in goals if not g[1]]
    print(f"\n{'PASS' if not missed else 'FAIL'}: {len(goals) - len(missed)} of {len(goals)} goals met")


def charts(directory, rows, samples):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    t0 = samples[0]["t"] if samples else (rows[0]["start_unix"] if rows else 0)
    minutes = [(r["end_unix"] - t0) / 60 for r in rows]
    sample_minutes = [(s["t"] - t0) / 60 for s in samples]

    def save(name, title, ylabel, series, x):
        fig, ax = plt.subplots(figsize=(9, 3.2))
        for label, ys in series.items():
            ax.plot(x[: len(ys)], ys, marker="o" if x is minutes else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("minutes since the soak began")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if len(series) > 1:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        fig.tight_layout()
        fig.savefig(os.path.join(directory, f"{name}.png"), dpi=90)
        plt.close(fig)

    save("throughput", "Rides per second, per window", "rides/s",
         {"rides/s": [r["rides_per_s"] for r in rows]}, minutes)
    save("latency", "Latency per window (first attempt to final answer)", "ms",
         {"p50": [r["p50_ms"] for r in rows], "p99": [r["p99_ms"] for r in rows]}, minutes)
    labels = sorted({k for r in rows for k in r["errors"]})
    save("errors", "Answers not OK per window, by reason (attempts; retried)", "attempts",
         {k: [r["errors"].get(k, 0) for r in rows] for k in labels} or {"none": [0 for _ in rows]}, minutes)
    procs = SERVICE_PROCS + OTHER_PROCS
    save("rss", "RSS per process (postgres: PSS of all its processes)", "MB",
         {p: [memory_kb(s["procs"][p], p) / 1024 for s in samples] for p in procs}, sample_minutes)
    save("cpu", "CPU per process, per window", "cores",
         {p: [r["cpu_cores"].get(p, 0) for r in rows] for p in procs}, minutes)
    tables = sorted({k for s in samples for k in (((s.get("db") or {}).get("tables")) or {})})
    tables = [t for t in tables if any(table_bytes(s, t) > 1e5 for s in samples)]
    save("tables", "Table + index size", "MB",
         {t: [table_bytes(s, t) / 1e6 for s in samples] for t in tables}, sample_minutes)
    save("dead_tuples", "Dead tuples (autovacuum on)", "tuples",
         {t: [((((s.get("db") or {}).get("tables")) or {}).get(t) or {}).get("dead", 0) for s in samples]
          for t in tables}, sample_minutes)
    save("backlog", "Staged-job backlog: oldest job's age", "s",
         {"oldest staged job": [((s.get("db") or {}).get("staged_oldest_age_s") or 0) for s in samples]},
         sample_minutes)
    save("caches", "The api-server's in-memory tables", "entries",
         {c: [((s.get("caches") or {}).get(c) or 0) for s in samples] for c in CACHES}, sample_minutes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--charts")
    parser.add_argument("--no-drift-goals", action="store_true")
    args = parser.parse_args()
    try:
        windows = read_jsonl(os.path.join(args.out, "windows.jsonl"))
        samples = read_jsonl(os.path.join(args.out, "samples.jsonl"))
    except (OSError, ValueError) as error:
        print(f"soak_report: cannot read the soak's output: {error}", file=sys.stderr)
        return 2
    samples = [s for s in samples if s.get("procs")]
    final = read_json(os.path.join(args.out, "final.json"))
    reconciler = read_json(os.path.join(args.out, "reconciler-final.json"))
    settings = read_json(os.path.join(args.out, "settings.json"), {})
    loadgen = read_json(os.path.join(args.out, "loadgen.jsonl"), {})
    key_ttl_s = float(os.environ.get("KEY_TTL_SECS", "600"))
    rows = [window_row(w, samples) for w in windows]
    for r, w in zip(rows, windows):
        r["start_unix"], r["end_unix"] = w["start_unix"], w["end_unix"]
    goals = judge(rows, samples, final, reconciler, loadgen, key_ttl_s, not args.no_drift_goals)
    print_report(args.out, rows, goals, final, settings, loadgen)
    if args.charts and rows and samples:
        charts(args.charts, rows, samples)
        print(f"\nCharts: {args.charts}/")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"rows": rows, "goals": [list(g) for g in goals], "final": final}, f, indent=1)
    return 0 if all(met for _, met, _ in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
