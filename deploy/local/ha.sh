#!/usr/bin/env bash
# The high-availability topology on one machine, on loopback and ports of its own (issue 17):
#   - etcd (one member) as Patroni's consensus store;
#   - PostgreSQL under Patroni: a primary and a synchronous standby (synchronous_mode,
#     synchronous_commit=on), so a commit a client saw is on both before it is acknowledged;
#   - RabbitMQ: three clustered nodes sharing the system node's Erlang cookie.
# Nothing here is home-made failover: Patroni promotes, rewinds and re-joins; RabbitMQ replicates
# the quorum queues. The script only starts, stops, breaks and reports.
#
#   deploy/local/ha.sh up                 start everything (installs patroni/etcd-server if absent)
#   deploy/local/ha.sh env                print DATABASE_URL and AMQP_URL for the topology
#   deploy/local/ha.sh database-url [DB]  the multi-host URL alone (default DB rocket_rides)
#   deploy/local/ha.sh amqp-url           the three nodes' URLs, comma-separated
#   deploy/local/ha.sh status             Patroni's member list and the RabbitMQ cluster
#   deploy/local/ha.sh kill-primary       SIGKILL the primary's postmaster; Patroni fails over
#   deploy/local/ha.sh switchover         a planned switchover to the synchronous standby
#   deploy/local/ha.sh kill-broker N      SIGKILL RabbitMQ node N (1-3)
#   deploy/local/ha.sh start-broker N     start RabbitMQ node N again (it re-joins the cluster)
#   deploy/local/ha.sh wait               until there is a primary, a sync standby and 3 brokers
#   deploy/local/ha.sh down               stop everything and delete its data
#
# Ports (HA_PORT_BASE, default 26000, clear of RabbitMQ’s own 25672, + offset): etcd 2379/2380 → base+379/+380; PostgreSQL
# base+432/+433; Patroni REST base+8/+9; RabbitMQ AMQP base+672..+674, distribution base+682..+684.
# Data, logs and configuration live in HA_DIR (default .run/ha).
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

BASE=${HA_PORT_BASE:-26000}
HA_DIR=${HA_DIR:-$REPO_ROOT/.run/ha}
ETCD_CLIENT=$((BASE + 379)) ETCD_PEER=$((BASE + 380))
PG_PORTS=($((BASE + 432)) $((BASE + 433)))
REST_PORTS=($((BASE + 8)) $((BASE + 9)))
AMQP_PORTS=($((BASE + 672)) $((BASE + 673)) $((BASE + 674)))
DIST_PORTS=($((BASE + 682)) $((BASE + 683)) $((BASE + 684)))
SCOPE=rocket-rides-ha
PG_USER=postgres RABBIT_USER=rabbitmq

# PostgreSQL refuses to run as root, and RabbitMQ's nodes must share the system node's cookie:
# as root, each runs as its package's user.
as_user() { # user command…
  local user=$1; shift
  if [ "$(id -u)" -eq 0 ]; then runuser -u "$user" -- "$@"; else "$@"; fi
}

database_url() {
  printf 'postgres://postgres:postgres@127.0.0.1:%s,127.0.0.1:%s/%s?target_session_attrs=read-write' \
    "${PG_PORTS[0]}" "${PG_PORTS[1]}" "${1:-rocket_rides}"
}
amqp_url() {
  local port urls=()
  for port in "${AMQP_PORTS[@]}"; do urls+=("amqp://guest:guest@127.0.0.1:$port/%2f"); done
  (IFS=,; printf '%s' "${urls[*]}")
}
rest() { curl -fsS --max-time 2 "http://127.0.0.1:$1$2"; }

ensure_packages() {
  local missing=()
  command -v patroni >/dev/null || missing+=(patroni)
  command -v etcd >/dev/null || missing+=(etcd-server)
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing+=(rabbitmq-server)
  ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing+=(postgresql)
  [ ${#missing[@]} -eq 0 ] && return
  [ "$(id -u)" -eq 0 ] || command -v sudo >/dev/null ||
    die "missing Debian packages: ${missing[*]} (install them as root: apt-get install ${missing[*]})"
  apt_install "${missing[@]}"
}

start_etcd() {
  port_open 127.0.0.1 "$ETCD_CLIENT" && return
  mkdir -p "$HA_DIR/etcd"
  log "etcd on 127.0.0.1:$ETCD_CLIENT"
  ETCD_UNSUPPORTED_ARCH= nohup etcd --name rr-etcd --data-dir "$HA_DIR/etcd/data" \
    --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT" --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "rr-etcd=http://127.0.0.1:$ETCD_PEER" --listen-metrics-urls "" \
    >"$HA_DIR/etcd/etcd.log" 2>&1 &
  echo $! >"$HA_DIR/etcd/pid"
  wait_for_port 127.0.0.1 "$ETCD_CLIENT" etcd 30
}

patroni_config() { # index
  local i=$1 dir="$HA_DIR/pg$1" bin
  bin=$(newest_postgres_bin)
  # primary_start_timeout 0: a crashed primary is failed over at once rather than restarted in
  # place, which is what a dead machine would force anyway. ttl ≥ loop_wait + 2 × retry_timeout.
  cat >"$dir/patroni.yml" <<EOF
scope: $SCOPE
namespace: /rocket-rides/
name: pg$i
log: {level: WARNING}
restapi:
  listen: 127.0.0.1:${REST_PORTS[$i - 1]}
  connect_address: 127.0.0.1:${REST_PORTS[$i - 1]}
etcd3:
  hosts: 127.0.0.1:$ETCD_CLIENT
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 1
    retry_timeout: 4
    primary_start_timeout: 0
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        synchronous_commit: "on"
        max_connections: 400
        wal_log_hints: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 256MB
  initdb:
    - encoding: UTF8
    - locale: C.UTF-8
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication replicator 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:${PG_PORTS[$i - 1]}
  connect_address: 127.0.0.1:${PG_PORTS[$i - 1]}
  data_dir: $dir/data
  bin_dir: $bin
  pgpass: $dir/pgpass
  authentication:
    superuser: {username: postgres, password: postgres}
    replication: {username: replicator, password: replicator}
    rewind: {username: postgres, password: postgres}
  parameters:
    unix_socket_directories: '$dir'
EOF
}

start_patroni() { # index
  local i=$1 dir="$HA_DIR/pg$1"
  if [ -f "$dir/patroni.pid" ] && kill -0 "$(cat "$dir/patroni.pid")" 2>/dev/null; then return; fi
  mkdir -p "$dir" && patroni_config "$i"
  [ "$(id -u)" -ne 0 ] || chown -R "$PG_USER" "$dir"
  log "Patroni node pg$i: PostgreSQL on 127.0.0.1:${PG_PORTS[$i - 1]}, REST on ${REST_PORTS[$i - 1]}"
  # The pid written is Patroni's own, not runuser's (which would not pass a signal on).
  # shellcheck disable=SC2016
  as_user "$PG_USER" sh -c 'echo $$ >"$1"; exec patroni "$2"' sh "$dir/patroni.pid" "$dir/patroni.yml" \
    >>"$dir/patroni.log" 2>&1 </dev/null &
}

broker_env() { # index → BROKER_ENV
  local i=$1 dir="$HA_DIR/rabbit$1"
  BROKER_ENV=("RABBITMQ_NODENAME=rr-ha-$i@localhost" "RABBITMQ_NODE_IP_ADDRESS=127.0.0.1"
    "RABBITMQ_NODE_PORT=${AMQP_PORTS[$i - 1]}" "RABBITMQ_DIST_PORT=${DIST_PORTS[$i - 1]}"
    "RABBITMQ_CONF_ENV_FILE=$dir/rabbitmq-env.conf" "RABBITMQ_CONFIG_FILE=$dir/rabbitmq"
    "RABBITMQ_ENABLED_PLUGINS_FILE=$dir/enabled_plugins" "RABBITMQ_MNESIA_BASE=$dir/mnesia"
    "RABBITMQ_LOG_BASE=$dir/log" "RABBITMQ_PID_FILE=$dir/pid" "HOME=/var/lib/rabbitmq"
    "ERL_EPMD_ADDRESS=127.0.0.1"
    # Erlang distribution on loopback only, like everything else here.
    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}")
}

rabbitmqctl_on() { # index args…
  local i=$1; shift
  as_user "$RABBIT_USER" env HOME=/var/lib/rabbitmq /usr/lib/rabbitmq/bin/rabbitmqctl -n "rr-ha-$i@localhost" "$@"
}

start_broker() { # index
  local i=$1 dir="$HA_DIR/rabbit$1"
  port_open 127.0.0.1 "${AMQP_PORTS[$i - 1]}" && return
  mkdir -p "$dir/log" "$dir/mnesia"
  : >"$dir/rabbitmq-env.conf"
  printf '[].\n' >"$dir/enabled_plugins"
  printf 'listeners.tcp.local = 127.0.0.1:%s\nloopback_users = none\n' "${AMQP_PORTS[$i - 1]}" >"$dir/rabbitmq.conf"
  [ "$(id -u)" -ne 0 ] || chown -R "$RABBIT_USER" "$dir"
  log "RabbitMQ node rr-ha-$i on 127.0.0.1:${AMQP_PORTS[$i - 1]}"
  broker_env "$i"
  as_user "$RABBIT_USER" env "${BROKER_ENV[@]}" /usr/lib/rabbitmq/bin/rabbitmq-server -detached >/dev/null 2>&1
  wait_for_port 127.0.0.1 "${AMQP_PORTS[$i - 1]}" "RabbitMQ node rr-ha-$i" 120
}

join_cluster() { # index
  local i=$1
  rabbitmqctl_on "$i" cluster_status 2>/dev/null | grep -q "rr-ha-1@localhost" && return
  log "RabbitMQ node rr-ha-$i joins rr-ha-1"
  rabbitmqctl_on "$i" stop_app >/dev/null
  rabbitmqctl_on "$i" join_cluster rr-ha-1@localhost >/dev/null
  rabbitmqctl_on "$i" start_app >/dev/null
}

primary_rest_port() {
  local port
  for port in "${REST_PORTS[@]}"; do
    rest "$port" /primary >/dev/null 2>&1 && { echo "$port"; return 0; }
  done
  return 1
}

sync_standby_present() {
  local port
  for port in "${REST_PORTS[@]}"; do
    rest "$port" /cluster 2>/dev/null | grep -q '"sync_standby"' && return 0
  done
  return 1
}

brokers_up() {
  local port
  for port in "${AMQP_PORTS[@]}"; do port_open 127.0.0.1 "$port" || return 1; done
}

wait_ready() { # seconds
  local deadline=$((SECONDS + ${1:-120}))
  log "waiting for a primary, a synchronous standby and three brokers"
  until [ $SECONDS -ge $deadline ]; do
    if primary_rest_port >/dev/null && sync_standby_present && brokers_up; then return 0; fi
    sleep 1
  done
  die "the HA topology did not become ready in time (logs in $HA_DIR)"
}

create_database() {
  local port; port=$(primary_rest_port) || die "no primary"
  local pg=${PG_PORTS[0]}
  [ "$port" = "${REST_PORTS[0]}" ] || pg=${PG_PORTS[1]}
  psql -q "postgres://postgres:postgres@127.0.0.1:$pg/postgres" -tAc \
    "SELECT 1 FROM pg_database WHERE datname = 'rocket_rides'" | grep -q 1 ||
    psql -q "postgres://postgres:postgres@127.0.0.1:$pg/postgres" -c "CREATE DATABASE rocket_rides" >/dev/null
}

cmd_up() {
  ensure_packages
  mkdir -p "$HA_DIR"
  [ "$(id -u)" -ne 0 ] || chmod 755 "$HA_DIR"
  start_etcd
  start_patroni 1
  start_patroni 2
  local i
  for i in 1 2 3; do start_broker "$i"; done
  join_cluster 2
  join_cluster 3
  wait_ready 180
  create_database
  log "HA topology up; export its URLs with: eval \"\$(deploy/local/ha.sh env)\""
}

cmd_env() {
  printf 'export DATABASE_URL=%q\nexport AMQP_URL=%q\n' "$(database_url)" "$(amqp_url)"
}

cmd_status() {
  as_user "$PG_USER" patronictl -c "$HA_DIR/pg1/patroni.yml" list 2>/dev/null || echo "Patroni: not running"
  local i
  for i in 1 2 3; do
    if rabbitmqctl_on "$i" cluster_status --formatter json 2>/dev/null | python3 -c \
      'import json,sys; print("RabbitMQ running nodes:", " ".join(json.load(sys.stdin)["running_nodes"]))'; then
      return
    fi
  done
  echo "RabbitMQ: no node of the cluster answers"
}

cmd_kill_primary() {
  local port pid i attempt
  # The primary may be restarting (a switchover just demoted it, Patroni is restarting it) and
  # its postmaster.pid stale for a moment: look again rather than kill nothing.
  for attempt in $(seq 30); do
    if port=$(primary_rest_port); then
      for i in 1 2; do [ "${REST_PORTS[$i - 1]}" = "$port" ] && break; done
      pid=$(head -n1 "$HA_DIR/pg$i/data/postmaster.pid" 2>/dev/null) || pid=
      if [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null; then
        log "SIGKILL of pg$i's postmaster (pid $pid)"
        # Patroni answers from its cached role until its next loop: return only once the killed
        # node no longer claims to be the primary, so that a `wait` after this measures the
        # failover rather than passing at once.
        local until=$((SECONDS + 30))
        while rest "$port" /primary >/dev/null 2>&1 && [ $SECONDS -lt $until ]; do sleep 0.2; done
        echo "pg$i"
        return
      fi
    fi
    sleep 1
  done
  die "found no running primary postmaster to kill in 30 s (attempt $attempt)"
}

cmd_switchover() {
  local leader candidate
  leader=$(rest "$(primary_rest_port)" /cluster | python3 -c \
    'import json,sys; print(next(m["name"] for m in json.load(sys.stdin)["members"] if m["role"] == "leader"))')
  candidate=$([ "$leader" = pg1 ] && echo pg2 || echo pg1)
  log "switchover $leader → $candidate"
  as_user "$PG_USER" patronictl -c "$HA_DIR/pg1/patroni.yml" switchover "$SCOPE" \
    --leader "$leader" --candidate "$candidate" --force >/dev/null
}

cmd_kill_broker() { # index
  local i=${1:?which node (1-3)?} pid
  pid=$(cat "$HA_DIR/rabbit$i/pid" 2>/dev/null) || die "no pid file for node $i"
  log "SIGKILL of RabbitMQ node rr-ha-$i (pid $pid)"
  kill -KILL "$pid"
  while port_open 127.0.0.1 "${AMQP_PORTS[$i - 1]}"; do sleep 0.2; done
}

# Every process of the topology names HA_DIR on its command line (Patroni's configuration,
# PostgreSQL's and etcd's data directories) or, for RabbitMQ's Erlang VMs, in its environment.
topology_pids() {
  {
    pgrep -f -- "$HA_DIR/" || true
    grep -lsF -- "RABBITMQ_MNESIA_BASE=$HA_DIR/" /proc/[0-9]*/environ | cut -d/ -f3 || true
  } | { grep -vx "$$" || true; } | sort -u | tr '\n' ' '
}

cmd_down() {
  [ -d "$HA_DIR" ] || { log "HA topology: nothing to stop"; return; }
  local i pid pids
  # Patroni stops its PostgreSQL cleanly on SIGTERM; everything else is only test data.
  for i in 1 2; do
    pid=$(cat "$HA_DIR/pg$i/patroni.pid" 2>/dev/null) && kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 20); do pgrep -f -- "$HA_DIR/pg./patroni.yml" >/dev/null || break; sleep 0.5; done
  for _ in 1 2 3; do
    pids=$(topology_pids)
    [ -n "$pids" ] || break
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 1
  done
  rm -rf "$HA_DIR"
  log "HA topology stopped and its data deleted"
}

case "${1:-}" in
  up) cmd_up ;;
  env) cmd_env ;;
  database-url) database_url "${2:-}"; echo ;;
  amqp-url) amqp_url; echo ;;
  status) cmd_status ;;
  kill-primary) cmd_kill_primary ;;
  switchover) cmd_switchover ;;
  kill-broker) cmd_kill_broker "${2:-}" ;;
  start-broker) start_broker "${2:?which node (1-3)?}" ;;
  wait) wait_ready "${2:-120}" ;;
  down) cmd_down ;;
  *) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
