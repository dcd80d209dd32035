#!/usr/bin/env bash
# Interleaved A/B windows of two api-server builds against the same stack: runs bench/run.sh
# PAIRS times for each build, alternating A, B, A, B, ..., and prints per scenario the median
# throughput, p50 and p99 of each side and the ratio B/A (docs/performance.md, "A/B").
#
#   A_BIN=path/to/older/api-server [B_BIN=target/release/api-server] [PAIRS=2] \
#     bench/ab.sh new-32 new-64 replay-32 riders-closed
#
# Build A from the commit before with its own target dir, e.g.
#   git worktree add --detach ../before <rev> && (cd ../before && \
#     CARGO_TARGET_DIR=../target-before cargo build --release -p api-server)
# A_ENV and B_ENV (space-separated NAME=value pairs, default empty) set bench/run.sh variables for
# one side only, so one build can be compared with itself under two settings, e.g.
#   A_BIN=target/release/api-server A_ENV=API_RUNTIME_THREADS=1 bench/ab.sh riders-closed
# Every other bench/run.sh variable applies (DURATION, RIDERS, ...); the batched-ceiling grid is
# skipped unless BATCHED_GRID is set, as a ratio between two builds needs no ceiling.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
: "${A_BIN:?A_BIN: the api-server binary of the build before}"
B_BIN=${B_BIN:-$REPO_ROOT/target/release/api-server}
PAIRS=${PAIRS:-2}
export BATCHED_GRID=${BATCHED_GRID-}
OUT=${AB_OUT:-$REPO_ROOT/target/bench/ab-$(date +%Y%m%d%H%M%S)}
mkdir -p "$OUT"
for ((pair = 1; pair <= PAIRS; pair++)); do
  for side in A B; do
    bin=$A_BIN side_env=${A_ENV-}
    [ "$side" = A ] || { bin=$B_BIN; side_env=${B_ENV-}; }
    echo "== pair $pair, side $side ($bin${side_env:+, $side_env})"
    # shellcheck disable=SC2086 # side_env is a list of NAME=value words
    env $side_env API_SERVER_BIN="$bin" BENCH_OUT="$OUT/$side-$pair" bench/run.sh "$@" >"$OUT/$side-$pair.log" 2>&1 ||
      echo "   bench/run.sh failed: see $OUT/$side-$pair.log"
  done
done
python3 - "$OUT" "$PAIRS" <<'PY'
import json, statistics, sys, pathlib
out, pairs = pathlib.Path(sys.argv[1]), int(sys.argv[2])
rows = {}
for side in "AB":
    for pair in range(1, pairs + 1):
        path = out / f"{side}-{pair}" / "results.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") != "loadgen":
                continue
            cell = rows.setdefault(row["scenario"], {"A": [], "B": []})[side]
            cell.append((row["throughput"], row.get("p50_ms"), row.get("p99_ms"), row.get("failed", 0)))
print("| scenario | A rides/s | B rides/s | B/A | A p50/p99 ms | B p50/p99 ms | failed A/B | windows |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for scenario, sides in sorted(rows.items()):
    med = {s: [statistics.median(v[i] for v in sides[s]) if sides[s] else float("nan") for i in range(3)] for s in "AB"}
    failed = {s: sum(v[3] or 0 for v in sides[s]) for s in "AB"}
    ratio = med["B"][0] / med["A"][0] if med["A"][0] else float("nan")
    print(f"| {scenario} | {med['A'][0]:.0f} | {med['B'][0]:.0f} | {ratio:.2f} | "
          f"{med['A'][1]:.1f}/{med['A'][2]:.1f} | {med['B'][1]:.1f}/{med['B'][2]:.1f} | "
          f"{failed['A']}/{failed['B']} | {len(sides['A'])}+{len(sides['B'])} |")
PY
echo "logs and results: $OUT"
