#!/usr/bin/env bash
# PostgreSQL alone: what the claim statement's writes cost a batch of replays (issue 47 item 2;
# docs/history/performance.md, run 35). The service's claim over BATCH finished keys
# (api-server/src/rides/claim_find.sql then claim.sql), against its read statement
# (claim_find.sql then claim_read.sql, what a claim that reads first sends), which has the same
# reads and none of the three INSERT CTEs (`inserted`, `ride`, `audit`). One pgbench client, as the service
# runs one claim batch at a time; PAIRS interleaved pairs of SECS-second windows, the order
# alternating. Prints each pair's mean latency and the ratio read-only / full.
#
#   [PG_ADMIN_URL=postgres://postgres@127.0.0.1:5432] [BATCH=10] [PAIRS=6] [SECS=10] \
#     bench/claim_writes.sh
#
# A scratch database (dropped at the end) migrated by the api-server and seeded by
# bench/pgbench/setup.sql; the statements are generated from the service's SQL files at each run,
# so they are its own text, with literals for its parameters.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=bench/lib.sh
. bench/lib.sh
die() { echo "claim_writes: $*" >&2; exit 1; }
ADMIN_URL=${PG_ADMIN_URL:-postgres://postgres@127.0.0.1:5432}
BATCH=${BATCH:-10} PAIRS=${PAIRS:-6} SECS=${SECS:-10}
DB=claim_writes_$$
DATABASE_URL="$ADMIN_URL/$DB"
OUT=$(mktemp -d)
trap 'psql "$ADMIN_URL/postgres" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true; rm -rf "$OUT"' EXIT

log "scratch database $DB"
psql "$ADMIN_URL/postgres" -qc "CREATE DATABASE $DB"
DATABASE_URL=$DATABASE_URL cargo run --locked -q -p api-server -- migrate >"$OUT/migrate.log" 2>&1 ||
  { cat "$OUT/migrate.log" >&2; die "migrations failed"; }
USER_BASE=$(psql "$DATABASE_URL" -At -v users=100 -v keys_per_user=50 -f bench/pgbench/setup.sql | tail -n1)
[ -n "$USER_BASE" ] || die "fixtures failed"

# The input CTE: BATCH random finished keys of the 100 fixture users, with the values the
# api-server binds; then the statement from its `caller` CTE on, with or without the writes.
python3 - "$OUT" <<'PY'
import sys
out = sys.argv[1]
find = open("api-server/src/rides/claim_find.sql").read()
find = find[find.index("caller AS ("):]
body = find + open("api-server/src/rides/claim.sql").read().rstrip().rstrip(";") + ";\n"
reads = find + open("api-server/src/rides/claim_read.sql").read().rstrip().rstrip(";") + ";\n"
params = '\'{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}\'::jsonb'
head = f"""WITH input AS (
    SELECT sha256(convert_to('pgbench-token-' || u, 'UTF8')) AS digest, NULL::int8 AS caller_id,
           'pgbench-replay-key-' || u || '-' || (1 + floor(random() * :keys_per_user))::int AS key,
           gen_random_uuid() AS token, NULL::int8 AS holder, 'POST'::text AS method,
           '/rides.v1.RideService/CreateRide'::text AS path, {params} AS params,
           37.7749::float8 AS origin_lat, -122.4194::float8 AS origin_lon,
           37.3382::float8 AS target_lat, -121.8863::float8 AS target_lon, 2000::int8 AS amount,
           'usd'::text AS currency, '127.0.0.1'::cidr AS origin_ip, 'bench'::text AS deployment_id,
           90::float8 AS lock_timeout, 5::float8 AS holder_takeover
    FROM (SELECT :user_base + floor(random() * :users)::int AS u
          FROM generate_series(1, :batch)) AS s
),
"""
open(f"{out}/full.sql", "w").write(head + body)
open(f"{out}/reads.sql", "w").write(head + reads)
PY

latency() { # script: mean latency in ms of one window
  PGOPTIONS="-c plan_cache_mode=force_generic_plan -c rocket_rides.provider_keys=deployment" \
    pgbench -n -M prepared -c 1 -j 1 -T "$SECS" -f "$OUT/$1.sql" -D user_base="$USER_BASE" \
    -D users=100 -D keys_per_user=50 -D batch="$BATCH" "$DATABASE_URL" >"$OUT/$1.log" 2>&1 ||
    { cat "$OUT/$1.log" >&2; die "pgbench $1 failed"; }
  awk '/^latency average/ {print $4}' "$OUT/$1.log"
}
log "$PAIRS pairs of $SECS s windows, one client, $BATCH replays per statement"
echo "pair full_ms reads_ms reads/full"
for pair in $(seq 1 "$PAIRS"); do
  if [ $((pair % 2)) = 1 ]; then full=$(latency full); reads=$(latency reads)
  else reads=$(latency reads); full=$(latency full); fi
  echo "$pair $full $reads $(awk -v r="$reads" -v f="$full" 'BEGIN {printf "%.2f", r / f}')"
done
# Nothing was inserted: every claim found its finished key.
keys=$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM idempotency_keys")
[ "$keys" = 5000 ] || die "the statements inserted keys ($keys, not 5000): not a replay batch"
