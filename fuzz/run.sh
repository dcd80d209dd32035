#!/usr/bin/env bash
# Builds and runs every cargo-fuzz target for SECONDS each (default 60), one after the other, and
# prints a line a target: executions, executions per second, coverage, corpus size, result.
# Exits non-zero if any target crashed, panicked, timed out or ran out of memory; the input that
# did it is in fuzz/artifacts/<target>/ (replay: `RUSTC_BOOTSTRAP=1 cargo fuzz run -a <target>
# <file>`), the full log in fuzz/artifacts/<target>.log.
#
#   fuzz/run.sh [SECONDS]          all targets
#   TARGETS="receipt_message" fuzz/run.sh 30
#
# Toolchain: cargo-fuzz passes `-Zsanitizer=address` (and the sancov flags) to rustc, which only a
# nightly compiler accepts. The project builds on stable, so RUSTC_BOOTSTRAP=1 lets stable rustc
# take the nightly flag; stable ships the AddressSanitizer runtime for x86_64 Linux. Where it does
# not, FUZZ_SANITIZER=none builds without one (panics and assertions are still caught).
#
# Inputs: seeds/<target>/ (committed, read-only to libFuzzer) and corpus/<target>/ (what libFuzzer
# found, kept between runs on this machine, ignored by git).
set -euo pipefail

seconds="${1:-60}"
cd "$(dirname "$0")"
# The fuzz crate has its own workspace; a CARGO_TARGET_DIR meant for the main one would mix
# instrumented and plain builds.
unset CARGO_TARGET_DIR
export RUSTC_BOOTSTRAP=1
sanitizer="${FUZZ_SANITIZER:-address}"
# -a: debug assertions and overflow checks, as in the workspace's tests.
flags=(-a --sanitizer "$sanitizer")

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

cargo fuzz build "${flags[@]}"

read -r -a targets <<<"${TARGETS:-$(cargo fuzz list | tr '\n' ' ')}"
mkdir -p artifacts
failed=()
summary=()
for target in "${targets[@]}"; do
    mkdir -p "corpus/$target" "seeds/$target"
    log="artifacts/$target.log"
    echo "fuzzing $target for ${seconds}s (log: fuzz/$log)" >&2
    status=ok
    if ! cargo fuzz run "${flags[@]}" "$target" "corpus/$target" "seeds/$target" -- \
        -max_total_time="$seconds" -timeout=10 -print_final_stats=1 >"$log" 2>&1; then
        status=FAILED
        failed+=("$target")
        tail -n 40 "$log" >&2
    fi
    stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -n 1; }
    coverage=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
    corpus=$(find "corpus/$target" -type f | wc -l)
    summary+=("$(printf '%-22s %5ss %12s execs %8s exec/s  cov %5s  corpus %5s  %s' \
        "$target" "$seconds" "$(stat number_of_executed_units)" \
        "$(stat average_exec_per_sec)" "${coverage:-?}" "$corpus" "$status")")
done

printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
    echo "crashed: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "no crashes"
