#!/usr/bin/env bash
# Instructions the api-server executes per request, counted by valgrind's callgrind: a count,
# not a time, so it repeats for the same binary and load whatever else the machine is doing,
# where a throughput window on a shared 2-core VM moves by ±20 % (docs/performance.md).
#
#   [API_SERVER_BIN=path/to/api-server] [CG_WINDOW=25] bench/callgrind.sh [scenario]
#
# Runs bench/run.sh's scenario (default new-32; any scenario of fresh keys: new-*, riders-closed)
# with the api-server under callgrind, zeroes its counters 3 s after the load generator starts,
# dumps them CG_WINDOW seconds later, and divides by the keys the database finished in between.
# Under callgrind the api-server is the bottleneck, so batches are fuller than in a timed window:
# compare two builds with this script, not with a throughput table. Prints one line; the profile
# is left in target/bench/callgrind-<time>/ for callgrind_annotate.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
command -v valgrind >/dev/null || { echo "bench/callgrind.sh: valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
SCENARIO=${1:-new-32}
WINDOW=${CG_WINDOW:-25}
BIN=${API_SERVER_BIN:-$REPO_ROOT/target/release/api-server}
OUT="$REPO_ROOT/target/bench/callgrind-$(date +%Y%m%d%H%M%S)"
mkdir -p "$OUT"
PROFILE="$OUT/callgrind.out"
cat >"$OUT/api-server" <<EOF
#!/usr/bin/env bash
exec valgrind --tool=callgrind --quiet --callgrind-out-file="$PROFILE" "$BIN" "\$@"
EOF
chmod +x "$OUT/api-server"

count_finished() { # database
  psql -h 127.0.0.1 -U postgres -d "$1" -XAtc "SELECT count(*) FROM idempotency_keys WHERE recovery_point = 'finished'"
}
measure() {
  local pid db before after
  until pid=$(pgrep -f "callgrind-out-file=$PROFILE" | head -1) && [ -n "$pid" ]; do sleep 0.5; done
  until pgrep -x loadgen >/dev/null; do sleep 0.2; done
  sleep 3
  db=$(psql -h 127.0.0.1 -U postgres -XAtc "SELECT datname FROM pg_database WHERE datname LIKE 'bench_%' ORDER BY oid DESC LIMIT 1")
  callgrind_control -z "$pid" >/dev/null 2>&1
  before=$(count_finished "$db")
  sleep "$WINDOW"
  callgrind_control -d "$pid" >/dev/null 2>&1
  after=$(count_finished "$db")
  echo $((after - before)) >"$OUT/requests"
}
measure &
watcher=$!
API_SERVER_BIN="$OUT/api-server" DURATION=$((WINDOW + 20)) PG_DURATION=2 WARMUP_SECS=0 BATCHED_GRID="" \
  BENCH_OUT="$OUT/run" bench/run.sh "$SCENARIO" >"$OUT/run.log" 2>&1 || { kill "$watcher" 2>/dev/null; echo "bench/run.sh failed: $OUT/run.log" >&2; exit 1; }
wait "$watcher"
requests=$(cat "$OUT/requests")
instructions=$(grep -m1 '^summary:' "$PROFILE.1" | awk '{print $2}')
[ "$requests" -gt 0 ] || { echo "bench/callgrind.sh: no request finished in the window" >&2; exit 1; }
echo "$SCENARIO $BIN: $instructions instructions for $requests finished keys = $((instructions / requests)) per request (profile: $PROFILE.1)"
