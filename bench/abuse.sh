#!/usr/bin/env bash
# The abuse campaign (docs/security.md): builds in release, starts fake-stripe and the api-server
# with its production defaults (no limit lifted, plaintext on loopback) against a scratch
# database, and runs `abuse`, which attacks the api-server while 16 legitimate clients keep
# creating and reading rides and a rider-facing backend (10,000 cold riders per run, 64 in
# flight over one connection from 127.0.0.2) creates rides. A second api-server with every
# defence lifted (bench/lib.sh's LIFTED_ENV) on the same database and provider is the backend's
# reference. About 12 minutes. Not part of CI. Exit code: abuse's (0 every goal met, 1 a goal
# missed).
#
#   bench/abuse.sh [abuse flags, e.g. --only streams,idle --attack-secs 10, --no-backend]
#
# Environment: PG_URL (server, default postgres://postgres@127.0.0.1:5432), ABUSE_OUT (output
# directory, default target/abuse/<run id>), API_SERVER_BIN (default target/release/api-server),
# PROVIDER_LATENCY_MS (fake-stripe's latency per call, default 250: a real card charge's).
# The attacks come from 127.x.y.z source addresses (Linux routes all of 127/8 to loopback).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
export PATH="$HOME/.cargo/bin:$PATH"

PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
RUN_ID="$(date +%Y%m%d%H%M%S)_$$"
DB="abuse_${RUN_ID}"
export DATABASE_URL="$PG_URL/$DB"
OUT=${ABUSE_OUT:-$REPO_ROOT/target/abuse/$RUN_ID}
GRPC_ADDR=127.0.0.1:25161
METRICS_ADDR=127.0.0.1:25162
REFERENCE_ADDR=127.0.0.1:25163
PROVIDER_LATENCY_MS=${PROVIDER_LATENCY_MS:-250}
STRIPE_ADDR=127.0.0.1:12221
export RUST_LOG=${RUST_LOG:-warn}
export STRIPE_SECRET_KEY=sk_test_rocket_rides_development
export STRIPE_API_BASE="http://$STRIPE_ADDR"

# shellcheck source=bench/lib.sh
. "$REPO_ROOT/bench/lib.sh"
die() { printf '\033[1;31merror:\033[0m %s\n' "$*" >&2; exit 2; }

for addr in $GRPC_ADDR $METRICS_ADDR $REFERENCE_ADDR $STRIPE_ADDR; do
  port_open "${addr%:*}" "${addr##*:}" && die "$addr is in use: another bench/abuse.sh running?"
done
command -v psql >/dev/null || die "psql is missing (apt-get install postgresql-client)"
psql "$PG_URL/postgres" -X -q -c 'SELECT 1' >/dev/null 2>&1 ||
  die "PostgreSQL is not reachable at $PG_URL (deploy/local/run.sh or deploy/local/test.sh starts it)"

mkdir -p "$OUT/logs"
log "run $RUN_ID -> $OUT"
log "building in release"
build_bench_binaries --release
BIN="$REPO_ROOT/target/release"
API_SERVER_BIN=${API_SERVER_BIN:-$BIN/api-server}

cleanup() {
  trap - INT TERM EXIT
  stop_all
  psql "$PG_URL/postgres" -X -q -c "DROP DATABASE IF EXISTS \"$DB\" WITH (FORCE)" >/dev/null 2>&1 ||
    log "could not drop database $DB"
}
trap cleanup INT TERM EXIT

log "scratch database $DB"
"$API_SERVER_BIN" migrate >"$OUT/logs/migrate.log" 2>&1 || die "migrate failed (see $OUT/logs/migrate.log)"
start fake-stripe "$BIN/fake-stripe" --listen "$STRIPE_ADDR" --latency-ms "$PROVIDER_LATENCY_MS"
wait_for_port "$STRIPE_ADDR" fake-stripe
GRPC_LISTEN_ADDR=$GRPC_ADDR METRICS_LISTEN_ADDR=$METRICS_ADDR start api-server "$API_SERVER_BIN" serve
GRPC_LISTEN_ADDR=$REFERENCE_ADDR METRICS_LISTEN_ADDR=off \
  start api-server-lifted env "${LIFTED_ENV[@]}" "$API_SERVER_BIN" serve
wait_for_port "$GRPC_ADDR" api-server
wait_for_port "$METRICS_ADDR" "api-server metrics"
wait_for_port "$REFERENCE_ADDR" "api-server with every defence lifted"

log "attacking (legitimate clients on 127.0.0.1, the backend on 127.0.0.2, attackers on other 127/8 addresses and, for the -own attacks, on 127.0.0.2; provider latency $PROVIDER_LATENCY_MS ms)"
status=0
"$BIN/abuse" --target "$GRPC_ADDR" --metrics "$METRICS_ADDR" --server-pid "${PIDS[api-server]}" \
  --reference-target "$REFERENCE_ADDR" --json-out "$OUT/results.json" "$@" | tee "$OUT/report.md" || status=$?
kill -0 "${PIDS[api-server]}" 2>/dev/null || { log "the api-server died (see $OUT/logs/api-server.log)"; status=1; }
log "results: $OUT/report.md, $OUT/results.json"
exit "$status"
