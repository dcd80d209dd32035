#!/usr/bin/env bash
# The receipt worker's throughput on its own (docs/workers.md, "Throughput"). Against a scratch
# database (migrations applied with psql): RECEIPT_JOBS synthetic paid rides (users, rides that
# record a charge, their staged receipt jobs, all inserted with SQL), published by
# `workers enqueuer --once`, then mailed by N `workers receipts` processes to one `mail-sink` that
# writes every mail as an .eml file (as bench/run.sh's receipts scenario does). Timed from the
# workers' start until `sent_receipts` holds every ride; one line per worker count, and
# results.jsonl in the output directory. It builds only workers and mail-sink (release).
#
#   bench/receipts.sh [N ...]        # worker counts, default "1 2 4"
#
# Environment: RECEIPT_JOBS (default 20000), PG_URL (default postgres://postgres@127.0.0.1:5432),
# AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f), BENCH_SMTP_ADDR (default
# 127.0.0.1:2725), BENCH_OUT (default $CARGO_TARGET_DIR/bench/receipts-<run id>), BENCH_MAIL_ROOT
# (where the sink writes, removed at exit; default under /dev/shm, else under BENCH_OUT), and the
# workers' own variables (RECEIPTS_PREFETCH, RECEIPTS_BATCH_SIZE, SMTP_POOL_SIZE, ...), passed
# through. Traffic goes to 127.0.0.1 only.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
TARGET=${CARGO_TARGET_DIR:-$REPO_ROOT/target}
RECEIPT_JOBS=${RECEIPT_JOBS:-20000}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
export AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
RUN_ID="$(date +%Y%m%d%H%M%S)_$$"
DB="bench_receipts_${RUN_ID}"
export DATABASE_URL="$PG_URL/$DB"
OUT=${BENCH_OUT:-$TARGET/bench/receipts-$RUN_ID}
SMTP_ADDR=${BENCH_SMTP_ADDR:-127.0.0.1:2725}
export SMTP_URL="smtp://$SMTP_ADDR" AMQP_TOPOLOGY_PREFIX="bench-receipts-$RUN_ID"
export METRICS_LISTEN_ADDR=off RUST_LOG=${RUST_LOG:-warn}
# The sink's mails go to memory (/dev/shm) when it can: on a disk mounted with `discard` (ext4
# here), writing 20,000 files just after as many were deleted made the sink CPU-bound and the run
# two to three times slower, a cost of the harness, not of the workers.
MAIL_ROOT=${BENCH_MAIL_ROOT:-$( [ -w /dev/shm ] && echo /dev/shm || echo "$OUT")/receipts-mail-$RUN_ID}
COUNTS=("$@")
[ ${#COUNTS[@]} -gt 0 ] || COUNTS=(1 2 4)

# shellcheck source=bench/lib.sh
. "$REPO_ROOT/bench/lib.sh"
die() { printf '\033[1;31merror:\033[0m %s\n' "$*" >&2; exit 1; }
la() { cut -d' ' -f1-3 /proc/loadavg; }
psql_db() { psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 "$@"; }
count() { psql_db -At -c "$1"; }
now() { date +%s.%N; }
command -v psql >/dev/null || die "psql is missing (apt-get install postgresql-client)"
port_open "${SMTP_ADDR%:*}" "${SMTP_ADDR##*:}" && die "$SMTP_ADDR is in use"

stop() { # name
  local pid=${PIDS[$1]:-}
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  unset "PIDS[$1]"
}
cleanup() {
  trap - INT TERM EXIT
  stop_all
  rm -rf "$MAIL_ROOT"
  psql "$PG_URL/postgres" -X -q -c "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 ||
    log "could not drop database $DB"
  if command -v rabbitmqctl >/dev/null; then
    for queue in $(timeout 60 rabbitmqctl list_queues -q name 2>/dev/null | grep "^$AMQP_TOPOLOGY_PREFIX" || true); do
      timeout 60 rabbitmqctl delete_queue "$queue" >/dev/null 2>&1 || true
    done
  fi
}
trap cleanup INT TERM EXIT
mkdir -p "$OUT/logs"
log "building in release"
build_bench_binaries --release
BIN="$TARGET/release"

psql "$PG_URL/postgres" -X -q -c "CREATE DATABASE \"$DB\"" >/dev/null
for migration in migrations/*/up.sql; do psql_db -f "$migration" >/dev/null; done
psql_db -v jobs="$RECEIPT_JOBS" <<'SQL' >/dev/null
INSERT INTO users (email, stripe_customer_id, stripe_payment_method_id, api_token_digest)
SELECT 'rider' || i || '@example.com', 'cus_bench_' || i, 'pm_card_visa', sha256(('bench-' || i)::bytea)
  FROM generate_series(1, 100) AS i;
INSERT INTO rides (origin_lat, origin_lon, target_lat, target_lon, amount, currency, stripe_charge_id, user_id)
SELECT 37.7749, -122.4194, 37.3382, -121.8863, 2000, 'usd', 'pi_bench_' || i, (i % 100) + 1
  FROM generate_series(1, :jobs) AS i;
SQL

results="$OUT/results.jsonl"
: >"$results"
run=0
for workers in "${COUNTS[@]}"; do
  psql_db -c "TRUNCATE sent_receipts, receipt_claims, staged_jobs" >/dev/null
  psql_db -c "INSERT INTO staged_jobs (job_name, job_args) SELECT 'send_ride_receipt',
      jsonb_build_object('ride_id', id, 'user_id', user_id, 'charge_id', stripe_charge_id,
        'amount', amount, 'currency', currency, 'created_at', created_at) FROM rides" >/dev/null
  "$BIN/workers" enqueuer --once >"$OUT/logs/enqueuer-$workers.log" 2>&1
  run=$((run + 1)); mail="$MAIL_ROOT/mail-$run"; mkdir -p "$mail"
  start mail-sink "$BIN/mail-sink" --listen "$SMTP_ADDR" --dir "$mail"
  wait_for_port "$SMTP_ADDR" mail-sink
  load=$(la); t0=$(now)
  for i in $(seq 1 "$workers"); do start "receipts-$i" "$BIN/workers" receipts; done
  deadline=$((SECONDS + 900)); sent=0
  while [ $SECONDS -lt $deadline ]; do
    sent=$(count 'SELECT count(*) FROM sent_receipts')
    [ "$sent" -lt "$RECEIPT_JOBS" ] || break
    sleep 0.1
  done
  t1=$(now)
  for i in $(seq 1 "$workers"); do stop "receipts-$i"; done
  stop mail-sink
  mails=$(find "$mail" -name '*.eml' | wc -l)
  rate=$(awk -v n="$sent" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", n / (b - a) }')
  seconds=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
  printf '{"workers":%s,"receipts":%s,"mails":%s,"seconds":%s,"per_sec":%s,"load_avg":"%s -> %s"}\n' \
    "$workers" "$sent" "$mails" "$seconds" "$rate" "$load" "$(la)" >>"$results"
  log "$workers worker(s): $sent receipts ($mails mails) in $seconds s = $rate/s (load $load -> $(la))"
done
cat "$results"
