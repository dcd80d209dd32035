#!/usr/bin/env bash
# Checks the rules against the real exporters: starts the api-server, the five workers,
# fake-stripe and the mail sink on loopback against the local PostgreSQL and RabbitMQ (a database
# and a topology prefix of its own), and a real Prometheus (Debian's package, 127.0.0.1:19090, its
# own data directory) run with compose's configuration (deploy/monitoring/prometheus/prometheus.yml:
# its jobs, labels and rule file, the targets moved to loopback, every 2 s).
# Then drives traffic through every path the rules read (CreateRide with replays, charges refused
# by the provider and left to the completer, expired keys for the reaper, a connection that is not
# HTTP/2, receipts mailed) and asserts through Prometheus's HTTP API (deploy/monitoring/live_check.py)
# that every metric and label the rules name exists and that every recording rule returns data,
# that every job of that configuration is up, and that every query of the Grafana dashboard
# (deploy/monitoring/dashboards/rocket-rides.json) names only metrics and labels that exist and
# returns data with a finite value.
# Exits non-zero otherwise; a renamed metric fails it. Stops everything it started.
#
# The rules on other exporters (rocket-rides-kubernetes and rocket-rides-ha: kube-state-metrics,
# CloudNativePG) are not checked here: those exporters do not run on this machine.
#
# Usage: deploy/monitoring/live-check.sh   (about a minute after the build; a debug build, in
#   CARGO_TARGET_DIR when it is set)
#   LIVE_CHECK_KEEP=1  keep the logs and Prometheus's data (.run/live-check) and the database
#                      (kept on failure too); the queues of the topology prefix
#                      monitoring-live-check stay on the broker, reused by the next run
#   LIVE_CHECK_CHARTS=DIR  after the checks pass, run LIVE_CHECK_CHARTS_SECS of load shaped like the
#                      production callers (a rider pool of LIVE_CHECK_CHARTS_RIDERS, 64 calls in
#                      flight over one connection, no client retry; a few replays from other riders
#                      every 10 s; three calls with a bad token at a quarter of the run, a burst of
#                      provider errors at half; the events of deploy/monitoring/chart-events.sh for
#                      the reaper, refused connections, keys needing attention and reconciliation
#                      findings) and draw the dashboard's panels from this Prometheus into DIR as
#                      PNGs (deploy/monitoring/charts.py; deploy/monitoring/charts.sh)
#   LIVE_CHECK_CHARTS_SECS   the load run's length (default 900)
#   LIVE_CHECK_CHARTS_RIDERS the rider pool (default 10000)
#   LIVE_CHECK_PROVIDER_LATENCY_MS  fake-stripe's latency per charge (default 0)
#   RULES=FILE         check another rule file (path from the repository root; default the one
#                      compose loads, deploy/monitoring/prometheus/rules/rocket-rides.rules.yaml),
#                      e.g. a copy with a metric renamed, which must fail
#   DASHBOARD=FILE     check another dashboard (default deploy/monitoring/dashboards/rocket-rides.json)
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../local/lib.sh"
cd "$REPO_ROOT"

WORK="$REPO_ROOT/.run/live-check"
PROM_ADDR=127.0.0.1:19090
GRPC_ADDR=127.0.0.1:19051
STRIPE_ADDR=127.0.0.1:19111
SMTP_ADDR=127.0.0.1:19025
MAIL_HTTP_ADDR=127.0.0.1:19026
API_METRICS=127.0.0.1:19464
# Worker metrics ports, in this order.
WORKERS=(enqueuer receipts completer reaper reconciler)
WORKER_PORTS=(19465 19466 19467 19468 19469)
DATABASE=monitoring_live_check
ADMIN_URL="postgres://postgres:postgres@127.0.0.1:5432/postgres"
RULES="$(realpath "${RULES:-deploy/monitoring/prometheus/rules/rocket-rides.rules.yaml}")"
DASHBOARD="$(realpath "${DASHBOARD:-deploy/monitoring/dashboards/rocket-rides.json}")"

ensure_postgres
ensure_rabbitmq
if ! command -v prometheus >/dev/null; then
  apt_install prometheus
  # The package enables a Prometheus on :9090; only the binary is wanted.
  if command -v systemctl >/dev/null; then as_root systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
fi
for addr in "$PROM_ADDR" "$GRPC_ADDR" "$STRIPE_ADDR" "$SMTP_ADDR" "$MAIL_HTTP_ADDR" "$API_METRICS" \
  "${WORKER_PORTS[@]/#/127.0.0.1:}"; do
  if port_open "${addr%:*}" "${addr##*:}"; then die "$addr is in use (another live-check.sh?)"; fi
done

log "building api-server, workers, fake-stripe, mail-sink, loadgen"
cargo build --locked --quiet --bin api-server --bin workers --bin fake-stripe --bin mail-sink --bin loadgen
bin="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/debug"

PYTHON=python3
[ -x "$REPO_ROOT/.run/venv/bin/python" ] && PYTHON="$REPO_ROOT/.run/venv/bin/python"
"$PYTHON" -c 'import yaml' 2>/dev/null || die "PyYAML is needed: run deploy/validate.sh once (it creates .run/venv)"

rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/mail" "$WORK/prometheus"
pids=()
cleanup() {
  local status=$?
  trap - INT TERM EXIT
  [ ${#pids[@]} -eq 0 ] || { kill -TERM "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; }
  if [ "$status" -ne 0 ] || [ "${LIVE_CHECK_KEEP:-0}" = 1 ]; then
    echo "logs, Prometheus data and database $DATABASE kept (${WORK#"$REPO_ROOT"/})" >&2
  else
    rm -rf "$WORK"
    psql "$ADMIN_URL" -Xq -c "DROP DATABASE IF EXISTS $DATABASE WITH (FORCE)" >/dev/null 2>&1 || true
  fi
  exit "$status"
}
trap cleanup INT TERM EXIT
start() { # name command...
  local name=$1; shift
  "$@" >"$WORK/logs/$name.log" 2>&1 &
  pids+=($!)
}

export DATABASE_URL="postgres://postgres:postgres@127.0.0.1:5432/$DATABASE"
export AMQP_TOPOLOGY_PREFIX=monitoring-live-check
export GRPC_LISTEN_ADDR="$GRPC_ADDR" STRIPE_API_BASE="http://$STRIPE_ADDR"
export STRIPE_SECRET_KEY=sk_test_rocket_rides_development
INTERNAL_API_TOKEN="internal-live-check-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
export INTERNAL_API_TOKEN
export API_SERVER_URL="http://$GRPC_ADDR" SMTP_URL="smtp://$SMTP_ADDR" MAIL_SEARCH_URL="http://$MAIL_HTTP_ADDR"
export RUST_LOG=info
# Fast loops, so that one minute exercises every worker: the completer takes keys a second old,
# the reaper and reconciler pass every 2 s (the reconciler looks at charges at once).
export COMPLETER_MIN_AGE_SECS=1 COMPLETER_IDLE_SECS=1 COMPLETER_INTERVAL_SECS=2 COMPLETER_BACKOFF_BASE_SECS=1
export REAPER_INTERVAL_SECS=2 RECONCILER_INTERVAL_SECS=2 RECONCILER_SETTLE_SECS=0

log "database $DATABASE (dropped and created)"
psql "$ADMIN_URL" -Xq -c "DROP DATABASE IF EXISTS $DATABASE WITH (FORCE)" -c "CREATE DATABASE $DATABASE" >/dev/null
"$bin/api-server" migrate >"$WORK/logs/migrate.log" 2>&1

start fake-stripe "$bin/fake-stripe" --listen "$STRIPE_ADDR" --latency-ms "${LIVE_CHECK_PROVIDER_LATENCY_MS:-0}"
start mail-sink "$bin/mail-sink" --listen "$SMTP_ADDR" --dir "$WORK/mail" --http-listen "$MAIL_HTTP_ADDR"
wait_for_port "${STRIPE_ADDR%:*}" "${STRIPE_ADDR##*:}" fake-stripe 30
wait_for_port "${SMTP_ADDR%:*}" "${SMTP_ADDR##*:}" mail-sink 30
METRICS_LISTEN_ADDR="$API_METRICS" start api-server "$bin/api-server" serve
wait_for_port "${GRPC_ADDR%:*}" "${GRPC_ADDR##*:}" api-server 60

# Compose's Prometheus configuration, each `<service>:9464` target moved to that process's port
# here; a job this script does not run fails (the two must keep the same processes).
ports="api-server=$API_METRICS"
for i in "${!WORKERS[@]}"; do ports+=" ${WORKERS[$i]}=127.0.0.1:${WORKER_PORTS[$i]}"; done
"$PYTHON" - deploy/monitoring/prometheus/prometheus.yml "$RULES" "$ports" >"$WORK/prometheus.yml" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))
ports = dict(pair.split("=", 1) for pair in sys.argv[3].split())
config["global"].update(scrape_interval="2s", evaluation_interval="2s")
config["rule_files"] = [sys.argv[2]]
for job in config["scrape_configs"]:
    for static in job["static_configs"]:
        moved = []
        for target in static["targets"]:
            service = target.rsplit(":", 1)[0]
            if service not in ports:
                sys.exit(f"live-check.sh: compose's Prometheus scrapes {target}, which it does not run")
            moved.append(ports.pop(service))
        static["targets"] = moved
if ports:
    sys.exit(f"live-check.sh: compose's Prometheus does not scrape {sorted(ports)}")
yaml.safe_dump(config, sys.stdout, sort_keys=False)
PY
start prometheus prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/prometheus" \
  --web.listen-address="$PROM_ADDR"
wait_for_port "${PROM_ADDR%:*}" "${PROM_ADDR##*:}" prometheus 30

loadgen() { # extra arguments...
  "$bin/loadgen" --target "http://$GRPC_ADDR" --stripe-base "http://$STRIPE_ADDR" \
    --database-url "$DATABASE_URL" --clients 2 --users 2 --warmup-secs 0 "$@"
}
log "traffic: CreateRide with replays"
loadgen --requests 40 --replay-ratio 0.25 --seed-keys-per-client 2 --scenario live-check \
  >"$WORK/logs/loadgen.log" 2>&1 || die "loadgen failed: $WORK/logs/loadgen.log"
log "traffic: charges the provider refuses (500), each key tried once and left to the completer"
curl -fsS -X POST "http://$STRIPE_ADDR/_faults" -H 'content-type: application/json' \
  -d '{"mode": "error_500", "count": 4}' >/dev/null
# These requests fail by design (one attempt each): the loadgen's own verdict is not the point.
loadgen --requests 4 --max-attempts 1 --scenario live-check-faults >"$WORK/logs/loadgen-faults.log" 2>&1 || true
log "traffic: a connection that is not HTTP/2 (refused: handshake_failed)"
# Longer than HTTP/2's 24-byte preface, so that the server reads a wrong preface at once (a shorter
# opening would wait out GRPC_PREFACE_TIMEOUT_MS and count as preface_timeout instead).
(exec 3<>"/dev/tcp/${GRPC_ADDR%:*}/${GRPC_ADDR##*:}"; printf 'GET / HTTP/1.1\r\nHost: live-check\r\n\r\n' >&3; cat <&3 >/dev/null) || true
log "traffic: a call with a token nobody issued (refused: failed_auth, a token lookup)"
bad_token_call() { # [more curl options]
  # A gRPC call by hand: an empty GetRideRequest in one length-prefixed frame.
  printf '\0\0\0\0\0' | curl -sS --http2-prior-knowledge -o /dev/null -H 'content-type: application/grpc' \
    -H 'te: trailers' -H 'authorization: Bearer live-check-not-a-token' --data-binary @- "$@" \
    "http://$GRPC_ADDR/rides.v1.RideService/GetRide"
}
bad_token_call || die "the gRPC call by curl failed"
age_keys() { # condition: the first three keys matching it aged past the key TTL; prints how many
  psql "$DATABASE_URL" -XAtq -c "WITH aged AS (UPDATE idempotency_keys SET created_at = now() - interval '1000 hours'
    WHERE id IN (SELECT id FROM idempotency_keys WHERE $1 ORDER BY id LIMIT 3) RETURNING 1) SELECT count(*) FROM aged"
}
log "traffic: three finished keys aged past IDEMPOTENCY_KEY_TTL_HOURS for the reaper"
age_keys "recovery_point = 'finished'" >/dev/null

# The completer's calls must show as an increase of the api-server's counters, so Prometheus needs a
# sample of them from before the workers start (without one every rate panel was NaN): wait for a
# scrape of the api-server after the traffic above.
traffic_end=$(date +%s)
scraped_since() { # unix time: has Prometheus sampled the api-server's call counter since then?
  curl -fsS -G "http://$PROM_ADDR/api/v1/query" --data-urlencode \
    "query=max(timestamp(rpc_server_call_duration_seconds_count{job=\"api-server\"})) >= $1" |
    "$PYTHON" -c 'import json, sys; sys.exit(0 if json.load(sys.stdin)["data"]["result"] else 1)'
}
log "waiting for Prometheus to scrape the api-server after the traffic"
until scraped_since "$traffic_end"; do
  [ "$(date +%s)" -lt $((traffic_end + 60)) ] || die "Prometheus did not scrape the api-server within 60 s"
  sleep 1
done

# The workers start after the traffic: loadgen's own check counts the staged jobs its requests left,
# which a running enqueuer would already have moved. They then drain what the traffic left.
for i in "${!WORKERS[@]}"; do
  METRICS_LISTEN_ADDR="127.0.0.1:${WORKER_PORTS[$i]}" start "${WORKERS[$i]}" "$bin/workers" "${WORKERS[$i]}"
  [ "${WORKERS[$i]}" != receipts ] || receipts_pid=${pids[-1]}
done

log "waiting for Prometheus to scrape and evaluate (assertions: deploy/monitoring/live_check.py)"
"$PYTHON" deploy/monitoring/live_check.py --prometheus "http://$PROM_ADDR" \
  --deadline-secs "${LIVE_CHECK_DEADLINE_SECS:-90}" --dashboard "$DASHBOARD" \
  --config "$WORK/prometheus.yml" --quiet RidesTargetDown --quiet RidesJobAbsent \
  --quiet RidesStagedJobsMetricsAbsent "$RULES"
echo "deploy/monitoring/live-check.sh: every metric and label the rules and the dashboard name is exported" >&2

if [ -n "${LIVE_CHECK_CHARTS:-}" ]; then
  charts_secs=${LIVE_CHECK_CHARTS_SECS:-900}
  riders=${LIVE_CHECK_CHARTS_RIDERS:-10000}
  # Real events for the panels a healthy load leaves at zero (reaper, refused connections, keys
  # needing attention, reconciliation findings): the first of each kind before the window.
  # shellcheck source=deploy/monitoring/chart-events.sh
  source deploy/monitoring/chart-events.sh
  chart_events_before || die "the events before the charts window failed: $WORK/logs/chart-events.log"
  log "load run for the charts: $riders riders, 64 calls in flight, ${charts_secs} s (users created first)"
  # The riders are created before the window: the charts begin with the load, not the setup.
  charts_load=("$bin/loadgen" --target "http://$GRPC_ADDR" --stripe-base "http://$STRIPE_ADDR"
    --database-url "$DATABASE_URL" --riders "$riders" --clients 64 --connections 1 --max-attempts 1
    --duration-secs "$charts_secs" --warmup-secs 0 --scenario live-check-charts --no-check)
  "${charts_load[@]}" >"$WORK/logs/loadgen-charts.log" 2>&1 &
  charts_loadgen=$!
  pids+=("$charts_loadgen")
  until grep -q '^created [0-9]* riders' "$WORK/logs/loadgen-charts.log" 2>/dev/null; do
    kill -0 "$charts_loadgen" 2>/dev/null || die "loadgen failed: $WORK/logs/loadgen-charts.log"
    sleep 1
  done
  charts_start=$(date +%s)
  chart_events
  (sleep $((charts_secs / 4)); for _ in 1 2 3; do bad_token_call || true; done) &
  pids+=($!)
  (sleep $((charts_secs / 2)); curl -fsS -X POST "http://$STRIPE_ADDR/_faults" \
    -H 'content-type: application/json' -d '{"mode": "error_500", "count": 20}' >/dev/null) &
  pids+=($!)
  # Replays, rider-shaped: every 10 s two new riders each make and replay a few keys.
  (while kill -0 "$charts_loadgen" 2>/dev/null; do
    loadgen --requests 8 --replay-ratio 0.5 --seed-keys-per-client 2 --scenario live-check-replays \
      --no-check >>"$WORK/logs/loadgen-replays.log" 2>&1 || true
    sleep 10
  done) &
  pids+=($!)
  wait "$charts_loadgen" || die "loadgen failed: $WORK/logs/loadgen-charts.log"
  sleep 30 # the workers drain what the load left; Prometheus scrapes it
  "${CHARTS_PYTHON:-$PYTHON}" deploy/monitoring/charts.py --prometheus "http://$PROM_ADDR" \
    --start "$charts_start" --end "$(date +%s)" --out "$LIVE_CHECK_CHARTS" "$DASHBOARD"
fi

# The scrape alerts, the other way round: with the receipt worker stopped, both expressions of
# RidesTargetDown (its target down; every target of its job down) return its series.
log "stopping the receipt worker: the scrape alert's expressions must see it"
kill -TERM "$receipts_pid"
wait "$receipts_pid" 2>/dev/null || true
"$PYTHON" deploy/monitoring/live_check.py --prometheus "http://$PROM_ADDR" --deadline-secs 60 \
  --expect-firing RidesTargetDown --job receipts "$RULES"
echo "deploy/monitoring/live-check.sh: RidesTargetDown sees a stopped process" >&2
