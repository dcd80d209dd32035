#!/usr/bin/env bash
# The house rules a compiler does not check: no Rust source file over MAX_LINES lines (500), in
# any crate, its tests, benches and binaries, proof/, bench/ and fuzz/ included. A file that long
# holds more than one concern; split it into modules (clippy's too_many_lines, set in clippy.toml,
# does the same for functions). Build output (every directory named target) and third-party code
# (vendor/, see vendor/README.md) are not looked at.
# Fails listing every file over the limit with its line count.
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

MAX_LINES="${MAX_LINES:-500}"

log "house rules: no .rs file over $MAX_LINES lines"
over=()
while IFS= read -r -d '' file; do
  lines=$(wc -l <"$file")
  if ((lines > MAX_LINES)); then
    over+=("$lines ${file#./}")
  fi
done < <(find . \( -name target -o -path ./vendor -o -name .git -o -name .run -o -name node_modules \) -prune -o -name '*.rs' -type f -print0)

if ((${#over[@]} > 0)); then
  echo "Rust files over $MAX_LINES lines (split each into modules by concern):" >&2
  printf '  %s\n' "${over[@]}" | sort -n >&2
  exit 1
fi
