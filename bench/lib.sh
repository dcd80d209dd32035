# Shared by bench/run.sh and bench/abuse.sh (sourced): logging, ports, and the processes they
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
