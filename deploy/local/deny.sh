#!/usr/bin/env bash
# Supply-chain check of the dependency tree against deny.toml (repository root): every license is
# on the allow list, no banned crate or wildcard version (two versions of one crate only warn),
# every crate comes from crates.io. cargo-deny is installed from crates.io when absent (once, a few
# minutes). The advisory check is not run: it fetches the RustSec database from GitHub, which this
# environment cannot reach (docs/operations.md, "Security advisories").
# Usage: deploy/local/deny.sh   (from anywhere; no arguments)
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

ensure_cargo
if ! cargo deny --version >/dev/null 2>&1; then
  log "installing cargo-deny from crates.io (once, a few minutes)"
  cargo install --locked cargo-deny >/dev/null
fi
cargo deny --locked check licenses bans sources
