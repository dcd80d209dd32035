# Shared by run.sh and test.sh: find, start or install what the project needs on this machine.
# Reuses a running PostgreSQL / RabbitMQ; starts an installed but stopped one; otherwise uses
# Docker Compose when a Docker engine answers, and installs Debian's packages when it does not.
# shellcheck shell=bash

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PATH="$HOME/.cargo/bin:$PATH"

log() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31merror:\033[0m %s\n' "$*" >&2; exit 1; }

# Run as root, through sudo when we are not root.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    die "need root to run: $* (install sudo or run as root)"; fi
}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# The newest installed PostgreSQL server's binaries (Debian's /usr/lib/postgresql/<major>/bin).
newest_postgres_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1; }

wait_for_port() { # host port what seconds
  local deadline=$((SECONDS + ${4:-60}))
  until port_open "$1" "$2"; do
    [ $SECONDS -lt $deadline ] || die "$3 did not come up on $1:$2"
    sleep 0.5
  done
}

# Fails before anything starts when a port that the caller's own processes bind is taken, naming
# each such port, what needs it and what holds it (the listening process, from `ss`). Arguments:
# "PORT what needs it". Never pass PostgreSQL's 5432 or RabbitMQ's 5672: those are reused when
# they answer (ensure_postgres, ensure_rabbitmq).
require_free_ports() { # "port what"...
  local entry port what holder taken=()
  for entry in "$@"; do
    port=${entry%% *} what=${entry#* }
    if command -v ss >/dev/null; then
      holder=$(ss -Hltnp "sport = :$port" 2>/dev/null | head -n1)
      [ -n "$holder" ] || continue
      holder=$(grep -o 'users:(([^)]*))' <<<"$holder" | sed -E 's/users:\(\("([^"]*)",pid=([0-9]+).*/\1 (pid \2)/')
    else
      port_open 127.0.0.1 "$port" || continue
      holder=
    fi
    taken+=("  port $port, needed by $what: held by ${holder:-a process ss cannot name (run as root to see it)}")
  done
  [ ${#taken[@]} -eq 0 ] && return
  printf '\033[1;31merror:\033[0m %s\n' "ports this run needs are taken (stop what holds them, or wait for the other run to end):" >&2
  printf '%s\n' "${taken[@]}" >&2
  exit 1
}

# Fails before anything is built when the filesystem that holds the build has less room than the
# run will write: a link that runs out of disk dies far into the run with a bus error (lld maps
# its output file), which names neither the disk nor what to do. The need is the build's full
# size less what its target directory already holds. Arguments: the full size in GiB, what it is.
require_free_disk() { # GiB what
  local dir=${CARGO_TARGET_DIR:-$REPO_ROOT/target} full_kib=$(($1 * 1024 * 1024))
  mkdir -p "$dir"
  local have_kib held_kib need_kib
  have_kib=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
  held_kib=$(du -sk "$dir" 2>/dev/null | awk '{print $1}')
  need_kib=$((full_kib > held_kib ? full_kib - held_kib : 0))
  log "disk: $((have_kib / 1048576)) GiB free for $dir, which holds $((held_kib / 1048576)) GiB; $2 writes about $1 GiB in all"
  [ "$have_kib" -ge "$need_kib" ] && return
  die "not enough disk for $2: $((need_kib / 1048576)) GiB more needed under $dir, $((have_kib / 1048576)) GiB free (free some, or point CARGO_TARGET_DIR at a larger disk)"
}

docker_engine() { command -v docker >/dev/null && docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; }

compose_up() { docker compose -f "$REPO_ROOT/deploy/local/compose.yaml" up -d "$@"; }

APT_UPDATED=
apt_install() {
  command -v apt-get >/dev/null || die "cannot install $*: no apt-get here (install it yourself, or start a Docker engine)"
  if [ -z "$APT_UPDATED" ]; then as_root apt-get update -qq; APT_UPDATED=1; fi
  log "installing $* from Debian's packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_cargo() {
  command -v cargo >/dev/null || die "Rust is not installed: install a current stable toolchain (rustup) first; this workspace needs Rust 1.95 or newer"
}

ensure_postgres() {
  if port_open 127.0.0.1 5432; then log "PostgreSQL: using the server on 127.0.0.1:5432"; return; fi
  if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 && docker_engine; then
    log "PostgreSQL: starting it with Docker Compose"; compose_up postgres
    wait_for_port 127.0.0.1 5432 PostgreSQL 90; return
  fi
  local installed_now=
  if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    apt_install postgresql postgresql-contrib; installed_now=1
  fi
  local version; version=$(ls /usr/lib/postgresql | sort -V | tail -n1)
  if ! pg_lsclusters -h 2>/dev/null | grep -q .; then
    as_root pg_createcluster "$version" main >/dev/null
  fi
  local cluster; cluster=$(pg_lsclusters -h | awk 'NR==1 {print $1" "$2}')
  log "PostgreSQL: starting cluster $cluster"
  # shellcheck disable=SC2086
  as_root pg_ctlcluster --skip-systemctl-redirect $cluster start 2>/dev/null || as_root pg_ctlcluster $cluster start
  wait_for_port 127.0.0.1 5432 PostgreSQL 60
  if [ -n "$installed_now" ]; then
    # Debian's cluster asks TCP clients for a password; give the development superuser the one
    # the default URLs carry.
    as_root runuser -u postgres -- psql -q -c "ALTER USER postgres PASSWORD 'postgres'" >/dev/null
  fi
}

ensure_rabbitmq() {
  if port_open 127.0.0.1 5672; then log "RabbitMQ: using the broker on 127.0.0.1:5672"; return; fi
  if ! command -v rabbitmq-server >/dev/null && ! [ -x /usr/sbin/rabbitmq-server ] && docker_engine; then
    log "RabbitMQ: starting it with Docker Compose"; compose_up rabbitmq
    wait_for_port 127.0.0.1 5672 RabbitMQ 120; return
  fi
  if ! command -v rabbitmq-server >/dev/null && ! [ -x /usr/sbin/rabbitmq-server ]; then
    apt_install rabbitmq-server
  fi
  log "RabbitMQ: starting the broker (the first boot takes about 15 s)"
  as_root rabbitmq-server -detached >/dev/null 2>&1 || true
  wait_for_port 127.0.0.1 5672 RabbitMQ 120
}

ensure_nextest() {
  cargo nextest --version >/dev/null 2>&1 && return
  log "installing cargo-nextest from crates.io (once, a few minutes)"
  cargo install --locked cargo-nextest >/dev/null
}

# Development defaults. The password is ignored by a trust-auth server and needed by Debian's.
export DATABASE_URL="${DATABASE_URL:-postgres://postgres:postgres@127.0.0.1:5432/rocket_rides}"
export TEST_DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres:postgres@127.0.0.1:5432/postgres}"
export AMQP_URL="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
export TEST_AMQP_URL="${TEST_AMQP_URL:-$AMQP_URL}"

# A throwaway CA and the certificates it signs, for run.sh's TLS=1: server.pem/.key for the
# api-server (valid for localhost, 127.0.0.1 and the listen host) and client.pem/.key for its
# clients (the completer, grpcurl). EC P-256 keys in PKCS#8, valid for 30 days; regenerated on
# every run, so nothing here is worth keeping.
make_tls_certificates() { # dir listen-host
  local dir=$1 host=$2 san="DNS:localhost,IP:127.0.0.1"
  command -v openssl >/dev/null || apt_install openssl
  case "$host" in
    127.0.0.1 | localhost | 0.0.0.0 | '') ;;
    *[!0-9.]*) san="$san,DNS:$host" ;;
    *) san="$san,IP:$host" ;;
  esac
  rm -rf "$dir" && mkdir -p "$dir" && chmod 700 "$dir"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
    -subj "/CN=Rocket Rides local CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
  local name subject extensions
  for name in server client; do
    if [ "$name" = server ]; then
      subject="/CN=api-server" extensions="subjectAltName=$san
extendedKeyUsage=serverAuth"
    else
      subject="/CN=rocket-rides-client" extensions="extendedKeyUsage=clientAuth"
    fi
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$subject" \
      -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null
    printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n%s\n' "$extensions" >"$dir/$name.ext"
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
      -CAcreateserial -days 30 -extfile "$dir/$name.ext" -out "$dir/$name.pem" 2>/dev/null
    rm -f "$dir/$name.csr" "$dir/$name.ext"
  done
  log "TLS: throwaway CA and certificates in $dir"
}
