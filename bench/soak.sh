#!/usr/bin/env bash
# The soak (issue 32, docs/reliability.md "Soak"): the whole system held at a steady load for
# SOAK_SECS (default one hour) at the production defaults, with the caller the defaults are for
# (one backend, one connection, each call a random rider of RIDERS created cold), the provider at
# 250 ms with a fault now and then, autovacuum on, and the completer, reaper and reconciler
# running their loops, the key TTL shortened so that the reaper deletes keys throughout.
#
#   bench/soak.sh            # one hour, 5-minute windows, charts
#   SOAK_SECS=86400 bench/soak.sh   # a day
#
# Every WINDOW_SECS the load generator writes the window's rides/s, latency and answers; every
# SAMPLE_SECS a sampler records each process's RSS and CPU, every table's and index's size and
# dead tuples, the staged-job backlog and the api-server's in-memory tables. After the traffic it
# drains (completer, enqueuer, receipts), runs a last reconciler pass up to the end (the loop's
# passes compared everything before it), and checks
# that every ride was charged once and receipted once. bench/soak_report.py then prints one row
# per window, judges the goals and draws a chart per series; the exit code is its verdict (0 all
# goals met, 1 a goal missed, 2 the soak could not run).
#
# Environment (defaults in brackets): SOAK_SECS [3600], WINDOW_SECS [300], SAMPLE_SECS [30],
# WARMUP_SECS [60, not measured], RIDERS [10000], SOAK_CLIENTS [36: calls in flight, about half
# of what the receipt pipeline sustains on this machine], PROVIDER_LATENCY_MS [250],
# PROVIDER_FAULT_EVERY_SECS [10: one provider fault (500, or a charge whose answer is lost)],
# KEY_TTL_SECS [600], REAPER_EVERY_SECS [60], COMPLETER_EVERY_SECS [60: its CronJob's schedule],
# RECONCILER_EVERY_SECS [300], SOAK_PROFILE [release | debug: the test command's short run uses
# the debug build it already has], SOAK_CHARTS [1; 0 skips matplotlib], SOAK_DRIFT_GOALS [1; 0
# judges only the invariants and the bounds, for runs too short for the drift goals],
# PG_BIN [the newest /usr/lib/postgresql/*/bin: a private cluster with autovacuum on; without
# one the shared server on 127.0.0.1:5432 is used and its autovacuum setting reported],
# SOAK_OUT [target/soak/<run id>].
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
export PATH="$HOME/.cargo/bin:$PATH"

SOAK_SECS=${SOAK_SECS:-3600}
WINDOW_SECS=${WINDOW_SECS:-300}
SAMPLE_SECS=${SAMPLE_SECS:-30}
WARMUP_SECS=${WARMUP_SECS:-60}
RIDERS=${RIDERS:-10000}
SOAK_CLIENTS=${SOAK_CLIENTS:-36}
PROVIDER_LATENCY_MS=${PROVIDER_LATENCY_MS:-250}
PROVIDER_FAULT_EVERY_SECS=${PROVIDER_FAULT_EVERY_SECS:-10}
KEY_TTL_SECS=${KEY_TTL_SECS:-600}
REAPER_EVERY_SECS=${REAPER_EVERY_SECS:-60}
COMPLETER_EVERY_SECS=${COMPLETER_EVERY_SECS:-60}
RECONCILER_EVERY_SECS=${RECONCILER_EVERY_SECS:-300}
SOAK_PROFILE=${SOAK_PROFILE:-release}
SOAK_CHARTS=${SOAK_CHARTS:-1}
SOAK_DRIFT_GOALS=${SOAK_DRIFT_GOALS:-1}
RUN_ID="$(date +%Y%m%d%H%M%S)_$$"
OUT=${SOAK_OUT:-$REPO_ROOT/target/soak/$RUN_ID}
mkdir -p "$OUT/logs" "$OUT/mail"

# deploy/local/lib.sh for ensure_*, then bench/lib.sh, whose start, stop_all and
# wait_for_port ADDR WHAT this script uses.
# shellcheck source=deploy/local/lib.sh
. "$REPO_ROOT/deploy/local/lib.sh"
# shellcheck source=bench/lib.sh
. "$REPO_ROOT/bench/lib.sh"
die() { printf '\033[1;31merror:\033[0m %s\n' "$*" >&2; exit 2; }
ensure_cargo
ensure_postgres
ensure_rabbitmq
command -v psql >/dev/null || die "psql is missing (apt-get install postgresql-client)"

# Ports of their own (below the ephemeral range), so a soak runs beside bench/run.sh and proof.
GRPC_ADDR=127.0.0.1:25351
API_METRICS_ADDR=127.0.0.1:25353
STRIPE_ADDR=127.0.0.1:12411
SMTP_ADDR=127.0.0.1:2825
MAIL_SEARCH_ADDR=127.0.0.1:8825
PG_PORT=25533
for addr in $GRPC_ADDR $API_METRICS_ADDR $STRIPE_ADDR $SMTP_ADDR $MAIL_SEARCH_ADDR 127.0.0.1:$PG_PORT; do
  port_open "${addr%:*}" "${addr##*:}" && die "$addr is in use: another soak running?"
done

log "soak $RUN_ID -> $OUT: ${SOAK_SECS} s at $SOAK_CLIENTS calls in flight over $RIDERS riders, windows of ${WINDOW_SECS} s ($SOAK_PROFILE build)"
if [ "$SOAK_PROFILE" = release ]; then build_bench_binaries --release; else build_bench_binaries; fi
BIN="$REPO_ROOT/target/$SOAK_PROFILE"

DB="soak_${RUN_ID}"
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
PG_BIN=${PG_BIN:-$(newest_postgres_bin)}
PG_DIR="$OUT/pg"
private_pg=
as_pg=()
export AMQP_TOPOLOGY_PREFIX="soak-$RUN_ID"
cleanup() {
  trap - INT TERM EXIT
  stop_all
  if [ -n "$private_pg" ]; then
    "${as_pg[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
    [ "${SOAK_KEEP:-0}" = 1 ] || rm -rf "$PG_DIR"
  else
    psql "$PG_URL/postgres" -X -q -c "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 || true
  fi
  if command -v rabbitmqctl >/dev/null; then
    local queue
    for queue in $(timeout 60 rabbitmqctl list_queues -q name 2>/dev/null | grep "^$AMQP_TOPOLOGY_PREFIX" || true); do
      timeout 60 rabbitmqctl delete_queue "$queue" >/dev/null 2>&1 || true
    done
  fi
  # The mail is counted; half a million files are not worth keeping.
  [ "${SOAK_KEEP:-0}" = 1 ] || rm -rf "$OUT/mail"
}
trap cleanup INT TERM EXIT

# PostgreSQL: a private cluster with autovacuum on (the machine's may run without it).
if [ -n "$PG_BIN" ] && [ -x "$PG_BIN/initdb" ]; then
  private_pg=1
  # initdb refuses root: as root, the cluster belongs to the postgres user, as Debian's does.
  if [ "$(id -u)" = 0 ]; then
    as_pg=(runuser -u postgres --)
  fi
  mkdir -p "$PG_DIR"
  [ ${#as_pg[@]} -eq 0 ] || chown postgres:postgres "$PG_DIR"
  "${as_pg[@]}" "$PG_BIN/initdb" -D "$PG_DIR/data" -U postgres --auth=trust --no-sync -E UTF8 >"$OUT/logs/initdb.log" 2>&1 ||
    die "initdb failed: $OUT/logs/initdb.log"
  "${as_pg[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/postgres.log" -w -t 60 start \
    -o "-p $PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories='$PG_DIR/data' -c max_connections=200 -c autovacuum=on" \
    >/dev/null || die "PostgreSQL did not start: $PG_DIR/postgres.log"
  PG_URL="postgres://postgres@127.0.0.1:$PG_PORT"
else
  log "no PostgreSQL server binaries here: the soak uses the shared server (autovacuum $(psql "$PG_URL/postgres" -XAtc 'show autovacuum'))"
fi
export DATABASE_URL="$PG_URL/$DB"
psql "$PG_URL/postgres" -X -q -c "CREATE DATABASE \"$DB\""

export AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
export RUST_LOG=${RUST_LOG:-warn}
export STRIPE_SECRET_KEY=sk_test_rocket_rides_development
export STRIPE_API_BASE="http://$STRIPE_ADDR"
export GRPC_LISTEN_ADDR=$GRPC_ADDR
export API_SERVER_URL="http://$GRPC_ADDR"
export SMTP_URL="smtp://$SMTP_ADDR"
export MAIL_SEARCH_URL="http://$MAIL_SEARCH_ADDR"
export INTERNAL_API_TOKEN="soak-internal-token-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
export IDEMPOTENCY_KEY_TTL_SECS=$KEY_TTL_SECS
export METRICS_LISTEN_ADDR=off

"$BIN/api-server" migrate >"$OUT/logs/migrate.log" 2>&1

start fake-stripe "$BIN/fake-stripe" --listen "$STRIPE_ADDR" --latency-ms "$PROVIDER_LATENCY_MS"
wait_for_port "$STRIPE_ADDR" fake-stripe
start mail-sink "$BIN/mail-sink" --listen "$SMTP_ADDR" --dir "$OUT/mail" --http-listen "$MAIL_SEARCH_ADDR"
wait_for_port "$SMTP_ADDR" mail-sink
# env execs the api-server, so its pid is the one sampled.
start api-server env METRICS_LISTEN_ADDR=$API_METRICS_ADDR "$BIN/api-server" serve
wait_for_port "$GRPC_ADDR" api-server
start enqueuer "$BIN/workers" enqueuer
start receipts "$BIN/workers" receipts
start completer env COMPLETER_INTERVAL_SECS="$COMPLETER_EVERY_SECS" "$BIN/workers" completer
start reaper env REAPER_INTERVAL_SECS="$REAPER_EVERY_SECS" "$BIN/workers" reaper
# A window of the reconciler ends a minute before now (production: 15 minutes, hourly).
start reconciler env RECONCILER_INTERVAL_SECS="$RECONCILER_EVERY_SECS" RECONCILER_SETTLE_SECS=60 \
  RECONCILER_LOOKBACK_HOURS=2 "$BIN/workers" reconciler

# The provider's usual faults: a 500 before anything is charged, or a charge whose answer is lost.
provider_faults() {
  local modes=(error_500 charge_then_drop)
  while sleep "$PROVIDER_FAULT_EVERY_SECS"; do
    curl -fsS -X POST -H 'content-type: application/json' \
      -d "{\"mode\":\"${modes[RANDOM % 2]}\",\"count\":1}" "http://$STRIPE_ADDR/_faults" >/dev/null 2>&1 || true
  done
}
provider_faults &
PIDS[provider-faults]=$!

# The sampler: one JSON line per SAMPLE_SECS with every process's RSS and CPU, the database's
# tables and indexes, the backlog, and the api-server's in-memory tables.
# PSS as well as RSS: PostgreSQL's processes share its buffers, which RSS would count once per
# backend.
proc_sample() { # name pid...: RSS, PSS (kB) and CPU ticks summed over the pids
  local name=$1 rss=0 pss=0 ticks=0 pid r p t
  shift
  for pid in "$@"; do
    r=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
    p=$(awk '/^Pss:/ {print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0)
    t=$(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)
    rss=$((rss + ${r:-0})) pss=$((pss + ${p:-0})) ticks=$((ticks + ${t:-0}))
  done
  printf '"%s":{"rss_kb":%d,"pss_kb":%d,"cpu_ticks":%d}' "$name" "$rss" "$pss" "$ticks"
}
# The CPU of PostgreSQL's exited processes (backends come and go), which the postmaster reaped:
# its cutime + cstime. Added to the live processes' ticks, the total never goes back.
postgres_exited_ticks() {
  local postmaster=0 ticks=0
  [ -z "$private_pg" ] || postmaster=$(head -n1 "$PG_DIR/data/postmaster.pid" 2>/dev/null || echo 0)
  ticks=$(awk '{print $16 + $17}' "/proc/$postmaster/stat" 2>/dev/null || echo 0)
  printf '"postgres-exited":{"rss_kb":0,"pss_kb":0,"cpu_ticks":%d}' "${ticks:-0}"
}
postgres_pids() {
  [ -n "$private_pg" ] || return 0
  local postmaster
  postmaster=$(head -n1 "$PG_DIR/data/postmaster.pid" 2>/dev/null) || return 0
  echo "$postmaster" $(pgrep -P "$postmaster" || true)
}
sampler() {
  local names=(api-server enqueuer receipts completer reaper reconciler fake-stripe mail-sink) name procs db metrics
  while true; do
    procs=""
    for name in "${names[@]}"; do procs+="$(proc_sample "$name" "${PIDS[$name]}"),"; done
    # shellcheck disable=SC2046
    procs+="$(proc_sample postgres $(postgres_pids))"
    procs+=",$(postgres_exited_ticks)"
    db=$(psql "$DATABASE_URL" -XAt -f "$REPO_ROOT/bench/soak_sample.sql" 2>/dev/null || echo null)
    metrics=$(curl -fsS "http://$API_METRICS_ADDR/metrics" 2>/dev/null |
      awk '/^(rides_admission_known_tokens|rides_admission_unknown_tokens|rides_admission_lookup_queue|rides_limits_tracked_callers|db_client_connection_count)[{ ]/ {
             name=$1; sub(/\{.*/, "", name); v[name]+=$NF }
           END { printf "{"; sep=""; for (n in v) { printf "%s\"%s\":%s", sep, n, v[n]; sep="," } printf "}" }' || echo null)
    printf '{"t":%s,"procs":{%s},"db":%s,"caches":%s}\n' "$(date +%s.%N)" "$procs" "${db:-null}" "${metrics:-null}" >>"$OUT/samples.jsonl"
    sleep "$SAMPLE_SECS"
  done
}
sampler &
PIDS[sampler]=$!

log "traffic: loadgen over $RIDERS cold riders, $SOAK_CLIENTS in flight, one connection"
loadgen_status=0
"$BIN/loadgen" --target "http://$GRPC_ADDR" --stripe-base "http://$STRIPE_ADDR" --stripe-key "$STRIPE_SECRET_KEY" \
  --database-url "$DATABASE_URL" --scenario soak --provider-latency-ms "$PROVIDER_LATENCY_MS" \
  --riders "$RIDERS" --clients "$SOAK_CLIENTS" --connections 1 \
  --warmup-secs "$WARMUP_SECS" --duration-secs "$SOAK_SECS" \
  --window-secs "$WINDOW_SECS" --windows-out "$OUT/windows.jsonl" \
  --server-pid "${PIDS[api-server]}" --json-out "$OUT/loadgen.jsonl" --no-check \
  2>&1 | tee "$OUT/logs/loadgen.log" || loadgen_status=$?
kill "${PIDS[provider-faults]}" 2>/dev/null || true
unset 'PIDS[provider-faults]'
curl -fsS -X DELETE "http://$STRIPE_ADDR/_faults" >/dev/null 2>&1 || true
[ "$loadgen_status" = 0 ] || die "loadgen failed (exit $loadgen_status): $OUT/logs/loadgen.log"

# The drain: the completer until no key is unfinished, then until every staged job went out and
# every receipt was mailed. Bounded: a system that never settles fails the invariants below.
psql_db() { psql "$DATABASE_URL" -XAt -c "$1"; }
drain_started=$SECONDS
log "draining: completer passes, then the enqueuer and the receipts"
while [ $((SECONDS - drain_started)) -lt 600 ]; do
  unfinished=$(psql_db "SELECT count(*) FROM idempotency_keys WHERE recovery_point <> 'finished'")
  backlog=$(psql_db "SELECT count(*) FROM staged_jobs")
  unsent=$(psql_db "SELECT count(*) FROM rides r WHERE NOT EXISTS (SELECT 1 FROM sent_receipts s WHERE s.ride_id = r.id)")
  [ "$unfinished$backlog$unsent" = 000 ] && break
  [ "$unfinished" = 0 ] || "$BIN/workers" completer --once >>"$OUT/logs/completer-drain.log" 2>&1 || true
  sleep 5
done
log "drained in $((SECONDS - drain_started)) s (unfinished keys $unfinished, staged jobs $backlog, rides without a receipt $unsent)"
# The provider and the mail sink stay up for the reconciler's pass.
for name in sampler api-server enqueuer receipts completer reaper reconciler; do
  kill -TERM "${PIDS[$name]}" 2>/dev/null || true
  wait "${PIDS[$name]}" 2>/dev/null || true
  unset "PIDS[$name]"
done

# A last reconciler pass from the loop's watermark to now (no settle delay, no overlap): with the
# loop's passes, every charge of the run compared with its ride.
sleep 1.1
RECONCILER_SETTLE_SECS=0 RECONCILER_OVERLAP_SECS=0 RECONCILER_LOOKBACK_HOURS=$((SOAK_SECS / 3600 + 2)) \
  "$BIN/workers" reconciler --once >"$OUT/reconciler-final.json" 2>"$OUT/logs/reconciler-final.log" ||
  log "the final reconciler pass failed: $OUT/logs/reconciler-final.log"
psql "$DATABASE_URL" -XAt -f "$REPO_ROOT/bench/soak_final.sql" \
  -v mail_files="$(find "$OUT/mail" -type f | wc -l)" >"$OUT/final.json"
stop_all
PIDS=()
psql "$DATABASE_URL" -XAtc "SELECT json_build_object('autovacuum', current_setting('autovacuum'), 'server_version', current_setting('server_version'))" >"$OUT/settings.json"

report_args=("$OUT")
[ "$SOAK_DRIFT_GOALS" = 1 ] || report_args+=(--no-drift-goals)
python=python3
# matplotlib from PyPI into target/soak-venv when the machine's python lacks it; without it the
# report is judged and printed, only the charts are skipped (said so).
chart_python() {
  python3 -c 'import matplotlib' 2>/dev/null && { echo python3; return; }
  local venv="$REPO_ROOT/target/soak-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >/dev/null 2>&1 || return 1
  "$venv/bin/python" -c 'import matplotlib' 2>/dev/null ||
    "$venv/bin/pip" install --quiet matplotlib >/dev/null 2>&1 || return 1
  echo "$venv/bin/python"
}
if [ "$SOAK_CHARTS" = 1 ]; then
  if python=$(chart_python); then
    report_args+=(--charts "$OUT/charts")
  else
    python=python3
    log "no matplotlib (python3 -m venv and pip install matplotlib failed): no charts"
  fi
fi
status=0
KEY_TTL_SECS=$KEY_TTL_SECS "$python" "$REPO_ROOT/bench/soak_report.py" "${report_args[@]}" | tee "$OUT/report.md" || status=${PIPESTATUS[0]}
log "soak $RUN_ID: report $OUT/report.md (exit $status)"
exit "$status"
