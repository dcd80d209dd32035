#!/usr/bin/env bash
# Builds the real binaries and runs the crash-and-fault campaign (see docs/reliability.md).
#   proof/run.sh [--short|--long] [more proof flags, e.g. --duration-secs 900 --seed 42 --keep]
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
cargo build --quiet -p api-server -p workers -p fake-stripe -p proof
exec target/debug/proof "$mode" "${args[@]}"
