# Shared by the bench scripts (sourced): logging, ports, the build, and the processes they
# start, whose logs go to $OUT/logs. Each script defines its own die() (its own exit code).
log() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
wait_for_port() { # addr what
  local deadline=$((SECONDS + 60))
  until port_open "${1%:*}" "${1##*:}"; do
    [ $SECONDS -lt $deadline ] || die "$2 did not come up on $1 (see $OUT/logs)"
    sleep 0.2
  done
}

# The api-server with every defence lifted: per-user rates and concurrency, the decline budget,
# the per-address budget of failed authentications, and the token-lookup places. The reference a
# run at the defaults is judged against (issue 28); api-server's limits::LIFTED is the same list
# for the tests, less the lookup places.
LIFTED_ENV=(
  RATE_LIMIT_CREATE_PER_SEC=1000000 RATE_LIMIT_CREATE_BURST=1000000
  RATE_LIMIT_GET_PER_SEC=1000000 RATE_LIMIT_GET_BURST=1000000
  MAX_CONCURRENT_CREATES_PER_USER=1000000 DECLINE_BUDGET_PER_10_MIN=1000000
  GRPC_REFUSALS_PER_IP_PER_SEC=1000000 MAX_CONCURRENT_TOKEN_LOOKUPS=1000000
)

# Every bench script builds the same five packages in one command. Cargo unifies features over
# the packages of a command, so a script that built only some of them got other features for
# the shared dependencies: bench/receipts.sh's two re-linked workers and mail-sink (five minutes
# of fat LTO on 2 cores, 2026-12-08) and measured another binary than bench/run.sh before it.
build_bench_binaries() { # [--release]
  cargo build --locked --quiet "$@" -p api-server -p workers -p fake-stripe -p mail-sink -p bench
}

# bench/run.sh's api-server metrics endpoint, read by loadgen at each end of a measured window for
# the batch fill per statement (the workers keep theirs off) and by bench/callgrind.sh for the
# calls answered in its window. bench/soak.sh sets its own.
API_METRICS_ADDR=127.0.0.1:25153

declare -A PIDS=()
start() { # name command...
  local name=$1; shift
  "$@" >"$OUT/logs/$name.log" 2>&1 &
  PIDS[$name]=$!
}
stop_all() { # SIGTERM to every process started, then wait for each
  local name
  for name in "${!PIDS[@]}"; do kill -TERM "${PIDS[$name]}" 2>/dev/null || true; done
  for name in "${!PIDS[@]}"; do wait "${PIDS[$name]}" 2>/dev/null || true; done
}
