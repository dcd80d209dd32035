# shellcheck shell=bash disable=SC2154  # bin, charts_start, charts_secs: set by live-check.sh
# The events of deploy/monitoring/live-check.sh's charts window (LIVE_CHECK_CHARTS), sourced by it:
# real events that drive the panels a healthy load leaves at zero, each through the mechanism
# that drives it in production, while the rider-shaped load runs. `chart_events` starts them in
# the background; each one logs the second of the window it acted at (logs/chart-events.log).
#
#   reaper         every minute, three finished keys aged past IDEMPOTENCY_KEY_TTL_HOURS (as the
#                  check before the window does): outcome `deleted`; the keys of two riders the
#                  completer gave up on, aged the same way at 5/12 and 7/12 of the run:
#                  `recorded_unfinished` (the first makes the series, the second is its increase)
#   refused        every minute a connection that is not HTTP/2 (handshake_failed); every two a
#                  silent one held past GRPC_PREFACE_TIMEOUT_MS (preface_timeout); every five
#                  minutes HTTP/2 connections from 127.0.0.2 up to the per-address cap, and three
#                  more (max_connections_per_ip); at a sixth, a half and five sixths of the run
#                  calls with a token nobody issued from 127.0.0.3 until the server shuts that
#                  address out, then three connections from it (shut_out). One of each before the
#                  window, so that each reason's series exists when the window begins.
#   attention and  the live check's own riders (customers cus_live_check_*), one CreateRide each:
#   findings       at 1/12 of the run, for one, fake-stripe takes the charge and drops the answer,
#                  then refuses every retry; at 1/4, for two others, it refuses every charge. The
#                  completer gives all three up (keys needing attention; outcome `gave_up`), the
#                  reconciler finds the first one's charge that no ride records
#                  (unrecorded_charge); at 1/6 a PaymentIntent planted at fake-stripe with this
#                  deployment's marker and no ride is an unknown_ride finding. Then an operator's
#                  `workers admin`: at 7/12 the unrecorded charge refunded, at 2/3 the planted one
#                  resolved, at 3/4 every attention row resolved. A step whose state has not come
#                  yet (the completer still retrying, the reconciler's pass not done) waits for it.
# The reconciler only reports (it runs without --refund); the one refund is the admin command's,
# of the live check's own rider's charge on fake-stripe.

LIVE_CHECK_PEER_CAP=127.0.0.2 # the address that fills the per-address connection cap
LIVE_CHECK_PEER_BAD=127.0.0.3 # the address shut out for its refused calls

chart_event() { # message: logged with the second of the window
  local line="before the window: $*"
  [ -z "${charts_start:-}" ] || line="t=$(($(date +%s) - charts_start)) s: $*"
  echo "$line" >>"$WORK/logs/chart-events.log"
  log "charts window, $line"
}

sleep_until() { # second of the window (short sleeps: a killed caller leaves no long sleep behind)
  while [ "$(date +%s)" -lt $((charts_start + $1)) ]; do sleep 1; done
}

# Runs `command` at `first` s into the window and every `period` s after it, until the window ends.
every() { # first period command...
  local first=$1 period=$2
  shift 2
  (
    t=$first
    while [ "$t" -lt "$charts_secs" ]; do
      sleep_until "$t"
      "$@" || chart_event "failed: $*"
      t=$((t + period))
    done
  ) &
  pids+=($!)
}

# Polls an SQL query until it returns a non-empty first row, at most until the window ends;
# prints that row.
wait_for_row() { # what query
  local what=$1 row
  while [ "$(date +%s)" -lt $((charts_start + charts_secs)) ]; do
    row=$(psql "$DATABASE_URL" -XAtq -c "$2" | head -n1)
    [ -z "$row" ] || { echo "$row"; return 0; }
    sleep 2
  done
  chart_event "gave up waiting for $what"
  return 1
}

peer() { # mode [arguments]: deploy/monitoring/peer.py against the api-server
  "$PYTHON" deploy/monitoring/peer.py "$@" --target "$GRPC_ADDR" 2>>"$WORK/logs/chart-events.log"
}

aged_finished_keys() {
  chart_event "reaper: $(age_keys "recovery_point = 'finished'") finished keys aged past the TTL"
}

not_http2() { peer not-http2 && chart_event "refused: a connection that is not HTTP/2"; }

silent_connection() {
  peer silent && chart_event "refused: a silent connection, closed at the preface timeout"
}

per_ip_cap() {
  peer fill --source "$LIVE_CHECK_PEER_CAP" --refused 3 &&
    chart_event "refused: $LIVE_CHECK_PEER_CAP filled the per-address cap; three more connections"
}

shut_out() {
  local calls=0 cut=0 batch pid _
  # Sixteen calls at once, one connection each (curl does not reuse its HTTP/2 connection for a
  # second POST), until the server cuts one: the address's budget of refused calls is spent. One
  # at a time, a loaded debug server answers slower than that budget refills.
  while [ "$cut" -eq 0 ] && [ "$calls" -lt 480 ]; do
    batch=()
    for _ in $(seq 16); do
      bad_token_call --interface "$LIVE_CHECK_PEER_BAD" 2>/dev/null &
      batch+=($!)
    done
    for pid in "${batch[@]}"; do wait "$pid" || cut=1; done
    calls=$((calls + 16))
  done
  peer refused --source "$LIVE_CHECK_PEER_BAD" --refused 3 &&
    chart_event "refused: $LIVE_CHECK_PEER_BAD shut out after $calls calls with a bad token; three connections"
}

# The live check's own rider: prints its user id and API token.
live_check_rider() { # name
  local token id
  token=$("$bin/api-server" users create --email "$1@live-check.invalid" \
    --stripe-customer-id "cus_live_check_$1" --stripe-payment-method-id pm_card_visa 2>/dev/null | tail -n1)
  id=$(psql "$DATABASE_URL" -XAtq -c "SELECT id FROM users WHERE stripe_customer_id = 'cus_live_check_$1'")
  echo "$id $token"
}

provider_fault_for() { # name mode count: fake-stripe's next charges of that rider's customer
  curl -fsS -X POST "http://$STRIPE_ADDR/_faults" -H 'content-type: application/json' \
    -d "{\"mode\": \"$2\", \"count\": $3, \"customer\": \"cus_live_check_$1\"}" >/dev/null
}

create_ride_once() { # token idempotency-key: one CreateRide by hand, one attempt, answer ignored
  "$PYTHON" -c 'import struct, sys
fields = b"".join(struct.pack("<Bd", tag, value) for tag, value in
                  ((0x09, 37.7749), (0x11, -122.4194), (0x19, 37.3382), (0x21, -121.8863)))
sys.stdout.buffer.write(b"\0" + struct.pack(">I", len(fields)) + fields)' |
    curl -sS --http2-prior-knowledge -o /dev/null -H 'content-type: application/grpc' -H 'te: trailers' \
      -H "authorization: Bearer $1" -H "idempotency-key: $2" --data-binary @- \
      "http://$GRPC_ADDR/rides.v1.RideService/CreateRide" || true
}

given_up() { # user id
  wait_for_row "the completer to give up user $1's key" "SELECT id FROM idempotency_keys
    WHERE user_id = $1 AND completer_gave_up_at IS NOT NULL"
}

admin() { "$bin/workers" admin "$@" >>"$WORK/logs/chart-events.log" 2>&1; }

# The riders' story, one step after another.
attention_and_findings() {
  local s=$charts_secs lost refused_b refused_c planted finding row
  sleep_until $((s / 12))
  read -r -a lost <<<"$(live_check_rider charge-lost)"
  provider_fault_for charge-lost charge_then_drop 1
  create_ride_once "${lost[1]}" live-check-charge-lost
  provider_fault_for charge-lost error_500 20
  chart_event "rider charge-lost (user ${lost[0]}): charged, the answer dropped; every retry answered 500"

  sleep_until $((s / 6))
  planted=$(curl -fsS "http://$STRIPE_ADDR/v1/payment_intents" -H "authorization: Bearer $STRIPE_SECRET_KEY" \
    -H "idempotency-key: live-check-planted-$charts_start" -d amount=1234 -d currency=usd \
    -d customer=cus_live_check_planted -d payment_method=pm_card_visa -d confirm=true \
    -d "description=monitoring live check: planted, no ride" -d "metadata[live_check]=planted" \
    -d "metadata[deployment_id]=${DEPLOYMENT_ID:-dev}" | jq -r .id)
  chart_event "planted at fake-stripe: $planted, this deployment's marker, no ride"

  sleep_until $((s / 4))
  read -r -a refused_b <<<"$(live_check_rider provider-refuses-b)"
  read -r -a refused_c <<<"$(live_check_rider provider-refuses-c)"
  provider_fault_for provider-refuses-b error_500 20
  provider_fault_for provider-refuses-c error_500 20
  create_ride_once "${refused_b[1]}" live-check-provider-refuses-b
  create_ride_once "${refused_c[1]}" live-check-provider-refuses-c
  chart_event "riders provider-refuses-b and -c (users ${refused_b[0]}, ${refused_c[0]}): every charge answered 500"

  given_up "${lost[0]}" >/dev/null && chart_event "completer gave up user ${lost[0]}'s key"
  provider_fault_for charge-lost error_500 0

  sleep_until $((5 * s / 12))
  given_up "${refused_b[0]}" >/dev/null && provider_fault_for provider-refuses-b error_500 0 &&
    chart_event "reaper: user ${refused_b[0]}'s given-up key aged: $(age_keys "user_id = ${refused_b[0]}")"

  sleep_until $((7 * s / 12))
  finding=$(wait_for_row "the unrecorded_charge finding" "SELECT id FROM reconciliation_findings
    WHERE kind = 'unrecorded_charge' AND user_id = ${lost[0]} AND resolved_at IS NULL") &&
    admin findings refund "$finding" --operator live-check --yes &&
    chart_event "operator: finding $finding refunded (workers admin findings refund)"
  given_up "${refused_c[0]}" >/dev/null && provider_fault_for provider-refuses-c error_500 0 &&
    chart_event "reaper: user ${refused_c[0]}'s given-up key aged: $(age_keys "user_id = ${refused_c[0]}")"

  sleep_until $((2 * s / 3))
  finding=$(wait_for_row "the unknown_ride finding" "SELECT id FROM reconciliation_findings
    WHERE kind = 'unknown_ride' AND payment_intent_id = '$planted' AND resolved_at IS NULL") &&
    admin findings resolve "$finding" --yes \
      --note "the live check's own PaymentIntent, planted at fake-stripe: nothing to settle" &&
    chart_event "operator: finding $finding resolved (workers admin findings resolve)"

  sleep_until $((3 * s / 4))
  local riders="${lost[0]}, ${refused_b[0]}, ${refused_c[0]}"
  # Three given up, two of them reaped unfinished.
  wait_for_row "five attention rows" "SELECT 1 FROM keys_needing_attention WHERE user_id IN ($riders)
    HAVING count(*) = 5" >/dev/null
  for row in $(psql "$DATABASE_URL" -XAtq -c "SELECT id FROM keys_needing_attention
      WHERE user_id IN ($riders) AND resolved_at IS NULL ORDER BY id"); do
    admin keys resolve --id "$row" --yes --note "the live check's own rider" &&
      chart_event "operator: attention row $row resolved (workers admin keys resolve)"
  done
}

# One refusal of each reason the window's events bring, before the window: a counter's first
# sample is no increase, so a reason first refused inside the window would draw nothing there.
chart_events_before() {
  : >"$WORK/logs/chart-events.log"
  silent_connection && per_ip_cap && shut_out
}

chart_events() {
  every 30 60 aged_finished_keys
  every 35 60 not_http2
  every 45 120 silent_connection
  every 150 300 per_ip_cap
  every $((charts_secs / 6)) $((charts_secs / 3)) shut_out
  (attention_and_findings || chart_event "failed: the riders' story") &
  pids+=($!)
}
