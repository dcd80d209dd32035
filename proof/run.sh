#!/usr/bin/env bash
# Builds the real binaries and runs the crash-and-fault campaign (see docs/reliability.md).
#   [TLS=1] proof/run.sh [--short|--long] [more proof flags, e.g. --duration-secs 900 --seed 42 --keep]
# Exit code = the campaign's: 0 all invariants hold, 1 a violation, 2 the campaign could not run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode=--short
args=()
for a in "$@"; do
  case "$a" in
    --short|--long) mode=$a ;;
    *) args+=("$a") ;;
  esac
done
cargo build --locked --quiet -p workers -p fake-stripe -p mail-sink -p proof
# Last, so that target/debug/api-server is the build with the crash points compiled in (the
# feature is never enabled by any other build, so release images never carry it).
cargo build --locked --quiet -p api-server --features fault-injection
# The campaign runs private copies: any other build in this tree (a test run, a benchmark) may
# replace target/debug/api-server with a build without the crash points while the campaign runs.
bin_dir="$PWD/target/proof-bin"
mkdir -p "$bin_dir"
for bin in api-server workers fake-stripe mail-sink proof; do
  cp -f "target/debug/$bin" "$bin_dir/$bin.new" && mv -f "$bin_dir/$bin.new" "$bin_dir/$bin"
done
args=(--bin-dir "$bin_dir" "${args[@]}")
# TLS=1: every gRPC hop over mutual TLS, with a throwaway CA and certificates (openssl).
if [ "${TLS:-0}" = 1 ]; then
  # shellcheck source=deploy/local/lib.sh
  . deploy/local/lib.sh
  tls_dir="$PWD/target/proof-tls"
  make_tls_certificates "$tls_dir" 127.0.0.1
  args+=(--tls-dir "$tls_dir")
fi
# --lb: HAProxy in front of the api-servers, from Debian's packages when absent.
if [[ " ${args[*]} " == *" --lb "* ]] && ! command -v haproxy >/dev/null; then
  # shellcheck source=deploy/local/lib.sh
  . deploy/local/lib.sh
  apt_install haproxy
fi
exec "$bin_dir/proof" "$mode" "${args[@]}"
