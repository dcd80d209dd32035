#!/usr/bin/env bash
# Instructions executed per request, counted by valgrind's callgrind: a count, not a time, so it
# repeats for the same binary and load whatever else the machine is doing, where a throughput
# window on a shared 2-core VM moves by ±20 % (docs/performance.md).
#
#   [CG_TARGET=api-server|postgres] [API_SERVER_BIN=path/to/api-server] [CG_WINDOW=25] \
#     bench/callgrind.sh [scenario]
#
# Runs bench/run.sh's scenario (default new-32; new-*, riders-closed, replay-32) and counts the
# instructions of one side over CG_WINDOW seconds of its load:
#   - CG_TARGET=api-server (default): the api-server, under callgrind; callgrind_control zeroes it
#     3 s after the load starts and dumps it at the window's end.
#   - CG_TARGET=postgres: a PostgreSQL of this script's own (initdb'd in the run's directory, port
#     25432, the shared server's settings that matter: autovacuum off, 128 MB of shared buffers,
#     fsync on), every process under callgrind. vgdb cannot reach forked children, so the server
#     is told instead: `pg_reload_conf()` makes every process enter ProcessConfigFile, where
#     callgrind zeroes it, and `pg_log_backend_memory_contexts()` makes each one enter
#     ProcessLogMemoryContextInterrupt, where callgrind dumps it. The count is the sum over the
#     api-server's backends and the WAL writer. The window opens 40 s into the load (see settle).
# Either window opens after the load generator's own set-up (replays' seeded keys, riders).
# It divides by the CreateRide calls the api-server answered in the window (its metrics endpoint).
# The process under callgrind is the bottleneck, so batches are fuller than in a timed window
# (the run's log prints the batch fill): compare two builds with this script, not with a
# throughput table. Prints one line; the profiles stay in target/bench/callgrind-<time>/.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
# shellcheck source=deploy/local/lib.sh
. "$REPO_ROOT/deploy/local/lib.sh"
# shellcheck source=bench/lib.sh
. "$REPO_ROOT/bench/lib.sh"
command -v valgrind >/dev/null || { echo "bench/callgrind.sh: valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
SCENARIO=${1:-new-32}
WINDOW=${CG_WINDOW:-25}
TARGET=${CG_TARGET:-api-server}
BIN=${API_SERVER_BIN:-$REPO_ROOT/target/release/api-server}
OUT="$REPO_ROOT/target/bench/callgrind-$(date +%Y%m%d%H%M%S)"
mkdir -p "$OUT"
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}

case "$TARGET" in
  api-server)
    PROFILE="$OUT/callgrind.out"
    cat >"$OUT/api-server" <<EOF
#!/usr/bin/env bash
exec valgrind --tool=callgrind --quiet --callgrind-out-file="$PROFILE" "$BIN" "\$@"
EOF
    chmod +x "$OUT/api-server"
    RUN_BIN="$OUT/api-server"
    PG_WINDOW=2
    LOAD_SECS=$((WINDOW + 60))
    settle() { sleep 3; }
    zero() { callgrind_control -z "$(pgrep -f "callgrind-out-file=$PROFILE" | head -1)" >/dev/null 2>&1; }
    dump() { callgrind_control -d "$(pgrep -f "callgrind-out-file=$PROFILE" | head -1)" >/dev/null 2>&1; }
    dumps() { echo "$PROFILE.1"; }
    until_ready() { until pgrep -f "callgrind-out-file=$PROFILE" >/dev/null; do sleep 0.5; done; }
    ;;
  postgres)
    PG_BIN=${PG_BIN:-$(newest_postgres_bin)}
    PG_PORT=25432
    PGDATA_DIR="$OUT/pgdata"
    as_pg=(); [ "$(id -u)" -ne 0 ] || { as_pg=(runuser -u postgres --); chown postgres "$OUT"; }
    "${as_pg[@]}" "$PG_BIN/initdb" -D "$PGDATA_DIR" -U postgres --auth=trust -E UTF8 >"$OUT/initdb.log"
    "${as_pg[@]}" bash -c "cd '$OUT' && exec valgrind --tool=callgrind --quiet \
      --zero-before=ProcessConfigFile --dump-before=ProcessLogMemoryContextInterrupt \
      --callgrind-out-file='$OUT/postgres.%p' '$PG_BIN/postgres' -D '$PGDATA_DIR' -p $PG_PORT -k '$OUT' \
      -c listen_addresses=127.0.0.1 -c autovacuum=off -c shared_buffers=128MB -c fsync=on \
      -c max_connections=200" >"$OUT/postgres.log" 2>&1 &
    PG_URL=postgres://postgres@127.0.0.1:$PG_PORT
    trap '"${as_pg[@]}" "$PG_BIN/pg_ctl" -D "$PGDATA_DIR" stop -m fast >/dev/null 2>&1 || true' EXIT
    until psql "$PG_URL/postgres" -XAtc 'SELECT 1' >/dev/null 2>&1; do sleep 1; done
    RUN_BIN=$BIN
    # pgbench's ceiling window must outlast 32 backends starting under callgrind.
    PG_WINDOW=45
    # ANALYZE under valgrind takes a minute or more: the load must outlast it, the settle and the
    # window.
    LOAD_SECS=$((WINDOW + 240))
    # The scratch database starts empty and this server does not analyze it (autovacuum off, as
    # on the shared server): a backend whose first charge record was planned on a nearly empty
    # `rides` keeps a plan that scans the whole table (the pool's plans are generic). ANALYZE
    # once the load has filled the tables makes every backend plan again, as autovacuum does in
    # production; then each PostgreSQL process, which translates the server's code anew under
    # valgrind, gets its first requests before the window.
    settle() {
      sleep 10
      psql "$PG_URL/$(psql "$PG_URL/postgres" -XAtc "SELECT datname FROM pg_database WHERE datname LIKE 'bench_%'")" \
        -XAtqc 'ANALYZE users, idempotency_keys, rides'
      sleep 30
    }
    zero() { psql "$PG_URL/postgres" -XAtc 'SELECT pg_reload_conf()' >/dev/null; }
    # Only the api-server's own backends (found by their client ports) and the WAL writer: the
    # load generator's sampler and this script's queries are not the service's cost, and when a
    # checkpoint or a background write falls in the window is luck, not the statements' form.
    dump() {
      local ports
      ports=$(ss -Htnp "dport = :$PG_PORT" | awk '/"api-server"/ { sub(/.*:/, "", $4); print $4 }' | paste -sd, -)
      psql "$PG_URL/postgres" -XAtc "SELECT count(pg_log_backend_memory_contexts(pid)) FROM pg_stat_activity
        WHERE backend_type = 'walwriter' OR client_port IN (${ports:-0})" >"$OUT/dumped-processes"
      sleep 5 # each process dumps when it next checks for interrupts
    }
    dumps() { ls "$OUT"/postgres.*.1; }
    until_ready() { :; }
    ;;
  *) echo "bench/callgrind.sh: CG_TARGET is api-server or postgres, not $TARGET" >&2; exit 2 ;;
esac

# CreateRide calls answered, from the api-server's own metrics endpoint (API_METRICS_ADDR,
# bench/lib.sh): fresh keys and replays alike.
answered() {
  curl -fsS "http://$API_METRICS_ADDR/metrics" | awk '/^rpc_server_call_duration_seconds_count/ { n += $NF } END { print n + 0 }'
}
measure() {
  local before after
  until_ready
  # The measured load generator (not its `--help`, which bench/run.sh asks first), then the
  # api-server's metrics: the window opens on a running load.
  until pgrep -f "loadgen .*--duration-secs" >/dev/null; do sleep 0.2; done
  until answered >/dev/null 2>&1; do sleep 0.5; done
  # A scenario's own set-up (finished keys seeded for replays, riders created) is not its load.
  local setup_done=
  case "$SCENARIO" in
    replay*) setup_done='^seeded [0-9]+ finished keys' ;;
    riders*) setup_done='^created [0-9]+ riders' ;;
  esac
  [ -z "$setup_done" ] || until grep -qE "$setup_done" "$OUT"/run/logs/loadgen-*.log 2>/dev/null; do sleep 0.5; done
  settle
  zero
  before=$(answered)
  sleep "$WINDOW"
  after=$(answered)
  dump
  echo $((after - before)) >"$OUT/requests"
}
measure &
watcher=$!
PG_URL=$PG_URL API_SERVER_BIN="$RUN_BIN" DURATION=$LOAD_SECS PG_DURATION=$PG_WINDOW WARMUP_SECS=0 BATCHED_GRID="" \
  BENCH_OUT="$OUT/run" bench/run.sh "$SCENARIO" >"$OUT/run.log" 2>&1 || { kill "$watcher" 2>/dev/null; echo "bench/run.sh failed: $OUT/run.log" >&2; exit 1; }
wait "$watcher"
requests=$(cat "$OUT/requests")
[ "$requests" -gt 0 ] || { echo "bench/callgrind.sh: no call was answered in the window" >&2; exit 1; }
# The sum of every function's own cost in each dump (the `summary:` line of a forked PostgreSQL
# process can still carry its parent's cost from before the fork).
mapfile -t profiles < <(dumps)
read -r processes instructions < <(python3 bench/callgrind_sum.py "${profiles[@]}")
echo "$SCENARIO $TARGET ($BIN): $instructions instructions in $processes processes for $requests calls = $((instructions / requests)) per request (profiles: $OUT)"
