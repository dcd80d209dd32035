#!/usr/bin/env bash
# Reproducible benchmark driver (docs/performance.md). Builds in release, starts fake-stripe,
# the api-server (and the workers and the mail sink for their scenarios) as separate processes on
# loopback ports that do not clash with deploy/local/run.sh, against a fresh scratch database,
# runs the pgbench ceiling and the load generator per scenario, prints the table and writes it to
# a file, then kills its processes, drops its database and deletes its RabbitMQ queues.
#
#   bench/run.sh [all | riders | riders-closed | riders-replay | riders-replay-cold | retry-wait | new | replay | latency | receipts | enqueuer | batched-ceiling | new-1 | new-8 | new-32 | new-64 ...]
#
# The headline (README, issue 47) is `riders-closed`: the callers' shape below against a 0 ms
# provider, a closed loop judged against the batched ceiling. Issue 28's pair is `riders`: a
# rider-facing backend at the api-server's production defaults (no limit lifted), RIDERS riders (default 10,000) created cold on a freshly started
# api-server, each request taking a random one, 64 in flight over one connection from one
# address, fake provider latency 250 ms, no client retry (--max-attempts 1); then, back to back,
# the same on an api-server with every defence lifted (riders-64-lifted, bench/lib.sh's
# LIFTED_ENV). The table's last lines divide the first by the second (goal: throughput >= 0.9,
# p99 <= 1.5x, no request failed). `riders-replay` is replays at the production defaults from the
# same callers' shape, each replay as the rider that made its key (the seeding, on the same
# api-server, made every rider a key and warmed its token); its ceiling is replay_reads.sql at 64
# clients. `riders-replay-cold` is the same with the keys made through another api-server, so that
# every rider's token is cold on the measured one, as after a restart (`riders-replay` selects it
# too). The other scenarios but retry-wait are closed loops on a few users, far above the per-user
# limits, which are lifted for them.
#
# Environment: DURATION (s per loadgen run, default 15), RIDERS (the pool of the riders-* scenarios,
# default 10000), PG_DURATION (s per pgbench run, default
# 15), ENQUEUER_JOBS (default 100000), RECEIPT_JOBS (receipts mailed in the receipts scenario,
# default 5000), PG_URL (server, default postgres://postgres@127.0.0.1:5432),
# AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f), RUNTIME_THREADS (tokio worker threads of
# loadgen and fake-stripe, the bench's own processes, default 1: on 2 cores shared with PostgreSQL
# a second thread per client process mostly adds wake-ups and steals), API_RUNTIME_THREADS (the
# api-server's tokio worker threads; default empty: the api-server's own default, one per CPU,
# since the bench measures the defaults), BENCH_SMTP_ADDR (the mail sink, default
# 127.0.0.1:2625), BENCH_OUT (output directory, default
# target/bench/<run id>), PERF=1 (profile the api-server during new-32, new-64, replay-32, riders-closed and
# latency250-500 with perf, cpu-clock; PERF_CALL_GRAPH, perf's --call-graph, default fp: the release
# build keeps no frame pointers, so `dwarf` is what attributes memmove and the allocator), ROUNDS (service windows per scenario, default 1; with n > 1 each scenario runs
# ceiling, service, ceiling, ... and is judged on the median of its n ratios, each to the mean of
# the ceilings either side: a single pgbench window on a shared machine moves a ratio by ±0.15),
# WARMUP_SECS (unrecorded pgbench load on the fresh database before any measured window,
# default 10; 0 skips it), BATCHED_GRID (the batched ceiling's pgbench runs, clients x rides per
# statement, default "2x16 2x32 2x64 4x16 4x32 4x64", empty skips it; run with any new-* or
# latency scenario, or alone as the scenario batched-ceiling), MERGED_CEILING=1 (also run that grid
# with create_ride_batched_merged.sql, the service's own two statements per fresh key, reported
# as merged-ceiling and not judged).
# API_SERVER_BIN (the api-server binary to measure, default target/release/api-server: for A/B
# runs of another build), ENQUEUER_BIN (the workers binary the enqueuer scenario drains with,
# default target/release/workers; an older build works against the newer schema, so the same
# database serves both sides), LOADGEN_BIN (the load generator, default target/release/loadgen:
# for A/B runs of the client side). Traffic goes to 127.0.0.1 only.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
export PATH="$HOME/.cargo/bin:$PATH"

DURATION=${DURATION:-15}
RIDERS=${RIDERS:-10000}
PG_DURATION=${PG_DURATION:-15}
ENQUEUER_JOBS=${ENQUEUER_JOBS:-100000}
RECEIPT_JOBS=${RECEIPT_JOBS:-5000}
RUNTIME_THREADS=${RUNTIME_THREADS:-1}
API_RUNTIME_THREADS=${API_RUNTIME_THREADS-}
ROUNDS=${ROUNDS:-1}
BATCHED_GRID=${BATCHED_GRID-2x16 2x32 2x64 4x16 4x32 4x64}
WARMUP_SECS=${WARMUP_SECS:-10}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
export AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
RUN_ID="$(date +%Y%m%d%H%M%S)_$$"
DB="bench_${RUN_ID}"
export DATABASE_URL="$PG_URL/$DB"
OUT=${BENCH_OUT:-$REPO_ROOT/target/bench/$RUN_ID}
RESULTS="$OUT/results.jsonl"
# Below the ephemeral range (32768-60999): start_stack restarts the api-server, and 500 outgoing
# connections must not be able to take its port meanwhile.
GRPC_ADDR=127.0.0.1:25151
# riders-replay-cold's second api-server, which makes the keys the measured one replays.
SEED_GRPC_ADDR=127.0.0.1:25152
STRIPE_ADDR=127.0.0.1:12211
SMTP_ADDR=${BENCH_SMTP_ADDR:-127.0.0.1:2625}
export AMQP_TOPOLOGY_PREFIX="bench-$RUN_ID"
export METRICS_LISTEN_ADDR=off
export RUST_LOG=${RUST_LOG:-warn}
export STRIPE_SECRET_KEY=sk_test_rocket_rides_development
export STRIPE_API_BASE="http://$STRIPE_ADDR"
export GRPC_LISTEN_ADDR=$GRPC_ADDR
export SMTP_URL="smtp://$SMTP_ADDR"
# The closed-loop scenarios' clients are each far above the api-server's per-user defaults (50
# CreateRide/s, 16 in flight): those scenarios measure throughput, so the per-user limits are
# lifted for them (start_stack's "closed-loop"). The riders scenarios run at the defaults and
# with every defence lifted (LIFTED_ENV, bench/lib.sh).
CLOSED_LOOP_ENV=(
  RATE_LIMIT_CREATE_PER_SEC=1000000 RATE_LIMIT_CREATE_BURST=1000000
  RATE_LIMIT_GET_PER_SEC=1000000 RATE_LIMIT_GET_BURST=1000000
  MAX_CONCURRENT_CREATES_PER_USER=1000000 DECLINE_BUDGET_PER_10_MIN=1000000
)

SCENARIOS=("$@")
[ ${#SCENARIOS[@]} -gt 0 ] || SCENARIOS=(all)
wants() { # scenario name -> selected?
  local s
  for s in "${SCENARIOS[@]}"; do
    [ "$s" = all ] && return 0
    case "$1" in "$s" | "$s"-*) return 0 ;; esac
    [ "$s" = latency ] && [ "${1%%250-*}" = latency ] && return 0
  done
  return 1
}

# shellcheck source=bench/lib.sh
. "$REPO_ROOT/bench/lib.sh"
die() { printf '\033[1;31merror:\033[0m %s\n' "$*" >&2; exit 1; }
la() { cut -d' ' -f1-3 /proc/loadavg; }
psql_db() { psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 "$@"; }

command -v pgbench >/dev/null || die "pgbench is missing (apt-get install postgresql-client)"
command -v psql >/dev/null || die "psql is missing (apt-get install postgresql-client)"
# The mail sink's port only matters to the receipts scenario (another campaign may hold it).
ports="$GRPC_ADDR $STRIPE_ADDR"
! wants riders-replay-cold || ports="$ports $SEED_GRPC_ADDR"
! wants receipts || ports="$ports $SMTP_ADDR"
for addr in $ports; do
  port_open "${addr%:*}" "${addr##*:}" && die "$addr is in use: another bench/run.sh running?"
done

mkdir -p "$OUT/logs"
: >"$RESULTS"
log "run $RUN_ID -> $OUT (scenarios: ${SCENARIOS[*]}); load average now $(la)"

log "building in release"
build_bench_binaries --release
BIN="$REPO_ROOT/target/release"
# A/B comparisons: another build's api-server against the same stack and database.
API_SERVER_BIN=${API_SERVER_BIN:-$BIN/api-server}
ENQUEUER_BIN=${ENQUEUER_BIN:-$BIN/workers}
LOADGEN_BIN=${LOADGEN_BIN:-$BIN/loadgen}

cleanup() {
  trap - INT TERM EXIT
  stop_all
  psql "$PG_URL/postgres" -X -q -c "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 ||
    log "could not drop database $DB"
  if command -v rabbitmqctl >/dev/null; then
    local queue
    for queue in $(timeout 60 rabbitmqctl list_queues -q name 2>/dev/null | grep "^$AMQP_TOPOLOGY_PREFIX" || true); do
      timeout 60 rabbitmqctl delete_queue "$queue" >/dev/null 2>&1 || true
    done
  fi
  if command -v rabbitmqadmin >/dev/null; then
    local exchange
    for exchange in $(timeout 30 rabbitmqadmin -f tsv -q list exchanges name 2>/dev/null | grep "^$AMQP_TOPOLOGY_PREFIX" || true); do
      timeout 30 rabbitmqadmin -q delete exchange name="$exchange" >/dev/null 2>&1 || true
    done
  fi
}
trap cleanup INT TERM EXIT

stop() { # name
  local pid=${PIDS[$1]:-}
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  unset "PIDS[$1]"
}
start_stack() { # provider latency ms, pool size, [closed-loop (default) | defaults | lifted]
  local limits=()
  case "${3:-closed-loop}" in
    closed-loop) limits=("${CLOSED_LOOP_ENV[@]}") ;;
    defaults) ;;
    lifted) limits=("${LIFTED_ENV[@]}") ;;
    *) die "start_stack: unknown limits $3" ;;
  esac
  stop api-server; stop fake-stripe
  TOKIO_WORKER_THREADS=$RUNTIME_THREADS start fake-stripe "$BIN/fake-stripe" --listen "$STRIPE_ADDR" --latency-ms "$1"
  wait_for_port "$STRIPE_ADDR" fake-stripe
  # env execs the api-server: its pid stays the one --server-pid and perf watch.
  # TOKIO_WORKER_THREADS is left unset unless API_RUNTIME_THREADS asks: the api-server's default.
  local threads=()
  [ -z "$API_RUNTIME_THREADS" ] || threads=(TOKIO_WORKER_THREADS="$API_RUNTIME_THREADS")
  METRICS_LISTEN_ADDR=$API_METRICS_ADDR DATABASE_POOL_SIZE=$2 \
    start api-server env -u TOKIO_WORKER_THREADS ${threads[@]+"${threads[@]}"} ${limits[@]+"${limits[@]}"} "$API_SERVER_BIN" serve
  wait_for_port "$GRPC_ADDR" api-server
  STACK_LATENCY=$1
}

log "scratch database $DB"
"$BIN/api-server" migrate >"$OUT/logs/migrate.log" 2>&1
PG_USERS=100
USER_BASE=$(psql_db -At -v users=$PG_USERS -v keys_per_user=50 -f bench/pgbench/setup.sql | tail -n1)
[ -n "$USER_BASE" ] || die "pgbench fixtures failed"
run_pgbench() { # script clients seconds log [pgbench options...]
  local script=$1 clients=$2 seconds=$3 logf=$4
  shift 4
  # The same plan cache mode as the api-server's pool (schema::PlanCache::Generic).
  # The sessions declare what the services' do (schema::tls::SESSION_DECLARATIONS), so the ceiling
  # pays what the service pays when it takes a key's lock.
  PGOPTIONS="-c plan_cache_mode=force_generic_plan -c rocket_rides.provider_keys=deployment" timeout $((seconds + 120)) pgbench -n -M prepared -c "$clients" -j 2 \
    -T "$seconds" -f "$script" -D user_base="$USER_BASE" -D users=$PG_USERS -D keys_per_user=50 "$@" "$DATABASE_URL" \
    >"$logf" 2>&1 || { cat "$logf" >&2; die "pgbench $script failed"; }
}

# The first pgbench window on a fresh database ran 20-35 % below the later ones (runs 10 and 11:
# 931/s then 1,363-1,591/s; 1,219/s then 1,433-1,437/s), which flattered the first service window
# beside it. A short unrecorded CreateRide load first, so that no measured window starts cold.
if [ "$WARMUP_SECS" -gt 0 ]; then
  log "warm-up: create_ride.sql, 16 clients, ${WARMUP_SECS} s (not recorded)"
  run_pgbench bench/pgbench/create_ride.sql 16 "$WARMUP_SECS" "$OUT/logs/pgbench-warmup.log"
fi

pgbench_ceiling() { # scenario script clients
  local scenario=$1 script=$2 clients=$3 logf="$OUT/logs/pgbench-$1-$(basename "$2" .sql).log" load
  load=$(la)
  run_pgbench "$script" "$clients" "$PG_DURATION" "$logf"
  load="$load -> $(la)"
  "$BIN/bench-report" pgbench "$scenario" "$(basename "$script")" "$clients" "$logf" "$load" >>"$RESULTS"
  log "pgbench $scenario $(basename "$script") c=$clients: $(grep '^tps' "$logf") (load $load)"
}

# The batched ceiling (docs/performance.md): create_ride_batched.sql, each phase written for B
# rides in one statement as the batching api-server writes it, over BATCHED_GRID (clients x B);
# the table divides every scenario of fresh keys by its best rides/s. Run whenever such a scenario
# is, so that both ceilings come from the same run.
batched_ceiling() { # scenario script
  local scenario=$1 script=$2 cell clients batch logf load
  for cell in $BATCHED_GRID; do
    clients=${cell%x*} batch=${cell#*x}
    logf="$OUT/logs/pgbench-$scenario-c$clients-b$batch.log"
    load=$(la)
    run_pgbench "bench/pgbench/$script" "$clients" "$PG_DURATION" "$logf" -D batch="$batch"
    load="$load -> $(la)"
    "$BIN/bench-report" pgbench "$scenario" "$script" "$clients" "$logf" "$load" "$batch" >>"$RESULTS"
    log "pgbench $scenario c=$clients B=$batch: $(grep '^tps' "$logf") x $batch rides (load $load)"
  done
}
fresh_keys_wanted() {
  local clients
  for clients in 1 8 32 64; do wants "new-$clients" && return 0; done
  wants latency250-500 || wants riders-closed
}
if wants batched-ceiling || fresh_keys_wanted; then
  batched_ceiling batched-ceiling create_ride_batched.sql
fi
# The service's own shape since run 23 (a fresh key's claim creates its ride): three statements.
# Reported beside the batched ceiling, not judged; only when asked for (MERGED_CEILING=1).
if [[ ${MERGED_CEILING:-0} == 1 ]] && { wants batched-ceiling || fresh_keys_wanted; }; then
  batched_ceiling merged-ceiling create_ride_batched_merged.sql
fi

loadgen() { # scenario args...
  local scenario=$1; shift
  log "loadgen $scenario $* (load $(la))"
  local cpu=()
  [ -z "${PIDS[fake-stripe]:-}" ] || cpu+=(--cpu-pid "fake-stripe=${PIDS[fake-stripe]}")
  # An older LOADGEN_BIN (A/B) may predate --metrics-url.
  ! "$LOADGEN_BIN" --help | grep -q -- --metrics-url || cpu+=(--metrics-url "http://$API_METRICS_ADDR/metrics")
  TOKIO_WORKER_THREADS=$RUNTIME_THREADS "$LOADGEN_BIN" --target "http://$GRPC_ADDR" --stripe-base "http://$STRIPE_ADDR" \
    --database-url "$DATABASE_URL" --scenario "$scenario" --provider-latency-ms "$STACK_LATENCY" \
    --server-pid "${PIDS[api-server]}" "${cpu[@]}" --json-out "$RESULTS" "$@" \
    2>&1 | tee "$OUT/logs/loadgen-$scenario.log" || log "loadgen $scenario: check FAILED or run failed"
}

# New keys at 1, 8, 32, 64 clients; default pool (16).
STACK_LATENCY=0
if wants new-1 || wants new-8 || wants new-32 || wants new-64 || wants replay-32; then
  start_stack 0 16
fi
# CPU profile of the api-server while a scenario runs (PERF=1; software clock: this VM has no
# hardware counters). perf_start before the loadgen run, perf_finish after it.
perf_pid=
perf_start() { # scenario
  perf_pid=
  case "$1" in new-32 | new-64 | replay-32 | riders-closed | latency250-500) ;; *) return 0 ;; esac
  [ "${PERF:-0}" = 1 ] && command -v perf >/dev/null || return 0
  (sleep 2; timeout $((DURATION + 30)) perf record -q -e cpu-clock -F 499 --call-graph "${PERF_CALL_GRAPH:-fp}" -p "${PIDS[api-server]}" \
    -o "$OUT/perf-api-server-$1.data" -- sleep $((DURATION - 2)) >/dev/null 2>&1) &
  perf_pid=$!
}
perf_finish() { # scenario
  [ -n "$perf_pid" ] || return 0
  wait "$perf_pid" || true
  perf report -i "$OUT/perf-api-server-$1.data" --stdio --no-children --sort dso,sym 2>/dev/null |
    grep -v '^$' | head -150 >"$OUT/perf-api-server-$1.txt" || true
  perf report -i "$OUT/perf-api-server-$1.data" --stdio --no-children --sort dso -g none 2>/dev/null |
    grep '%' | head -20 >"$OUT/perf-api-server-$1-dso.txt" || true
}

# A scenario's measurement: its ceiling, then ROUNDS times the service followed by the ceiling
# again (with ROUNDS=1 just ceiling, service), so each service window can be divided by the mean
# of the ceilings either side of it (bench-report). perf, if asked for, records the first round.
measure() { # scenario pgbench-script pgbench-clients loadgen-args...
  local scenario=$1 script=$2 pg_clients=$3 round
  shift 3
  pgbench_ceiling "$scenario" "$script" "$pg_clients"
  for ((round = 1; round <= ROUNDS; round++)); do
    [ "$round" -gt 1 ] || perf_start "$scenario"
    loadgen "$scenario" "$@"
    [ "$round" -gt 1 ] || perf_finish "$scenario"
    [ "$ROUNDS" -eq 1 ] || pgbench_ceiling "$scenario" "$script" "$pg_clients"
  done
}

for clients in 1 8 32 64; do
  wants "new-$clients" || continue
  measure "new-$clients" bench/pgbench/create_ride.sql "$clients" --clients "$clients" --duration-secs "$DURATION"
done

# Replays of finished keys at 32 clients. The write statement a replay sent as a first send is
# served by (one claim) is measured once, for the record; the goal's ceiling is the bare reads.
if wants replay-32; then
  pgbench_ceiling replay-32-as-served bench/pgbench/replay_claim.sql 32
  measure replay-32 bench/pgbench/replay_reads.sql 32 --clients 32 --duration-secs "$DURATION" \
    --replay-ratio 1 --seed-keys-per-client 50
fi

# Issue 28's pair: the rider pool at the production defaults, then the same with every
# defence lifted, back to back, ROUNDS times. Each run starts a fresh api-server (every token
# cold) and loadgen creates fresh riders. The pool is the default size (16).
if wants riders; then
  for ((round = 1; round <= ROUNDS; round++)); do
    for limits in defaults lifted; do
      scenario=riders-64
      [ "$limits" = defaults ] || scenario=riders-64-lifted
      start_stack 250 16 "$limits"
      loadgen "$scenario" --riders "$RIDERS" --clients 64 --connections 1 --max-attempts 1 \
        --duration-secs "$DURATION"
    done
  done
  start_stack 0 16
fi

# Fresh keys at the production defaults (no limit lifted) from callers of the riders' shape (also
# run by `bench/run.sh riders`, as every scenario named riders-*): a
# pool of RIDERS riders created cold, each call a random one, 64 in flight over one connection
# from one address, no client retry, and a fast provider (0 ms): a closed loop, so that what it
# measures is the service, not its clients (the riders scenario above is bounded by 64 calls per
# 250 ms). Measured like new-64: a pgbench ceiling in the same run, ROUNDS interleaved windows.
if wants riders-closed; then
  start_stack 0 16 defaults
  measure riders-closed bench/pgbench/create_ride.sql 64 --riders "$RIDERS" --clients 64 \
    --connections 1 --max-attempts 1 --duration-secs "$DURATION"
  start_stack 0 16
fi

# Replays at the production defaults from callers of the riders' shape (also run by `bench/run.sh
# riders`): the same pool and connection as riders-closed, every request a replay of a finished
# key as the rider that made it. The seeding gives each rider at least one key (ceil(RIDERS / 64)
# keys per client, riders round-robin), so it also warms every token on this api-server before the
# clock starts. Measured like replay-32: against replay_reads.sql, here at 64 clients.
if wants riders-replay; then
  start_stack 0 16 defaults
  measure riders-replay bench/pgbench/replay_reads.sql 64 --riders "$RIDERS" --clients 64 \
    --connections 1 --max-attempts 1 --duration-secs "$DURATION" \
    --replay-ratio 1 --seed-keys-per-client $(((RIDERS + 63) / 64))
  start_stack 0 16
fi

# The same replays on an api-server that has never seen the riders' tokens, as after a restart:
# the keys are made through a second api-server (same database, same defaults, SEED_GRPC_ADDR),
# so each rider's first replay on the measured one waits for its token's lookup. No warm-up: the
# cold first calls are what it measures (RIDERS of the window's calls; the rest are warm).
if wants riders-replay-cold; then
  start_stack 0 16 defaults
  METRICS_LISTEN_ADDR=off GRPC_LISTEN_ADDR=$SEED_GRPC_ADDR DATABASE_POOL_SIZE=16 \
    start api-seeder env -u TOKIO_WORKER_THREADS "$API_SERVER_BIN" serve
  wait_for_port "$SEED_GRPC_ADDR" api-seeder
  measure riders-replay-cold bench/pgbench/replay_reads.sql 64 --riders "$RIDERS" --clients 64 \
    --connections 1 --max-attempts 1 --duration-secs "$DURATION" \
    --replay-ratio 1 --seed-keys-per-client $(((RIDERS + 63) / 64)) --seed-target "http://$SEED_GRPC_ADDR" \
    --warmup-secs 0
  stop api-seeder
  start_stack 0 16
fi

# Issue 31, a duplicate in flight waits for the answer: clients that give up on an attempt after
# 100 ms (client-side, and sent as its grpc-timeout) and retry with the same key, against a
# 250 ms provider, at the production defaults; first with waiting off (`idempotency-wait: 0`:
# a retry that finds the first attempt running gets IDEMPOTENCY_KEY_IN_USE and its 1 s
# RetryInfo), then with the default. loadgen prints the claim statements per logical request
# and the p99 to the final answer of each.
if wants retry-wait; then
  for wait in off on; do
    start_stack 250 16 defaults
    opt_out=()
    [ "$wait" = on ] || opt_out=(--idempotency-wait-ms 0)
    loadgen "retry-wait-$wait" --riders "${RETRY_RIDERS:-1000}" --clients 32 --connections 1 \
      --attempt-timeout-ms 100 --max-attempts 30 --duration-secs "$DURATION" "${opt_out[@]}"
  done
  start_stack 0 16
fi

# Provider latency 250 ms, 500 clients, pool 16. The database sees at most 16 connections, so
# its ceiling is pgbench at 16 clients; the scenario's ceiling is min(that, 500 / 0.25 s).
if wants latency250-500; then
  start_stack 250 16
  measure latency250-500 bench/pgbench/create_ride.sql 16 --clients 500 --duration-secs "$DURATION"
  start_stack 0 16
fi

drain_record() { # scenario items seconds load note
  printf '{"kind":"drain","scenario":"%s","items":%s,"seconds":%s,"load_avg":"%s","note":"%s"}\n' \
    "$1" "$2" "$3" "$4" "$5" >>"$RESULTS"
  log "$1: $2 items in $3 s (load $4) $5"
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }
count() { psql_db -At -c "$1"; }

# Receipt worker rate: real rides' receipts, enqueued, then mailed to the mail sink.
if wants receipts; then
  if [ "$(count 'SELECT count(*) FROM staged_jobs')" -lt 2000 ]; then
    [ -n "${PIDS[api-server]:-}" ] || start_stack 0 16
    loadgen receipts-fill --clients 32 --duration-secs 10 --warmup-secs 0 --no-check >/dev/null
    sed -i '/"scenario":"receipts-fill"/d' "$RESULTS"
  fi
  # Earlier scenarios may have staged far more receipts than a drain needs to show its rate (run 9
  # left 230,923, an hour of mail); keep RECEIPT_JOBS of them. This is a scratch database.
  psql_db -c "DELETE FROM staged_jobs WHERE id > (SELECT id FROM staged_jobs ORDER BY id OFFSET $((RECEIPT_JOBS - 1)) LIMIT 1)" >/dev/null
  mkdir -p "$OUT/mail"
  start mail-sink "$BIN/mail-sink" --listen "$SMTP_ADDR" --dir "$OUT/mail"
  wait_for_port "$SMTP_ADDR" mail-sink
  jobs=$(count 'SELECT count(*) FROM staged_jobs')
  load=$(la); t0=$(now)
  "$BIN/workers" enqueuer --once >"$OUT/logs/enqueuer-receipts.log" 2>&1
  t1=$(now)
  drain_record enqueuer-real-jobs "$jobs" "$(elapsed "$t0" "$t1")" "$load -> $(la)" "workers enqueuer --once, real receipt jobs"
  load=$(la); t0=$(now)
  start receipts "$BIN/workers" receipts
  deadline=$((SECONDS + 600)); sent=0
  while [ $SECONDS -lt $deadline ]; do
    sent=$(count 'SELECT count(*) FROM sent_receipts')
    [ "$sent" -lt "$jobs" ] || break
    sleep 0.2
  done
  t1=$(now)
  stop receipts
  drain_record receipts "$sent" "$(elapsed "$t0" "$t1")" "$load -> $(la)" "workers receipts (defaults: RECEIPTS_PREFETCH 256, RECEIPTS_BATCH_SIZE 64, SMTP_POOL_SIZE 32) -> mail sink; $(ls "$OUT/mail" | wc -l) .eml files"
  stop mail-sink
fi

# Enqueuer drain: ENQUEUER_JOBS synthetic receipt jobs, published with confirms and deleted.
if wants enqueuer; then
  psql_db -c "DELETE FROM staged_jobs" >/dev/null
  psql_db -c "INSERT INTO staged_jobs (job_name, job_args, trace_context)
    SELECT 'send_ride_receipt', jsonb_build_object('ride_id', i, 'user_id', 1, 'amount', 2000, 'currency', 'usd',
           'charge_id', 'pi_bench_' || i, 'created_at', '2026-11-21T09:37:44.892483Z'), '{}'
    FROM generate_series(1, $ENQUEUER_JOBS) AS i" >/dev/null
  psql_db -c "VACUUM ANALYZE staged_jobs" >/dev/null
  load=$(la); t0=$(now); passes=0
  while [ "$(count 'SELECT count(*) FROM staged_jobs')" -gt 0 ] && [ $passes -lt 20 ]; do
    AMQP_TOPOLOGY_PREFIX="$AMQP_TOPOLOGY_PREFIX-enq" "$ENQUEUER_BIN" enqueuer --once >>"$OUT/logs/enqueuer.log" 2>&1
    passes=$((passes + 1))
  done
  t1=$(now)
  left=$(count 'SELECT count(*) FROM staged_jobs')
  drain_record enqueuer $((ENQUEUER_JOBS - left)) "$(elapsed "$t0" "$t1")" "$load -> $(la)" \
    "ENQUEUER_BATCH_SIZE=${ENQUEUER_BATCH_SIZE:-1000}, $passes x workers enqueuer --once, $left left"
fi

{
  echo "# bench/run.sh $RUN_ID ($(nproc) cores; other work on the machine shows in the load averages)"
  echo
  "$BIN/bench-report" table "$RESULTS"
} | tee "$OUT/table.md"
log "table: $OUT/table.md; raw: $RESULTS; logs: $OUT/logs"
