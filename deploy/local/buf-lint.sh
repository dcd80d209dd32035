#!/usr/bin/env bash
# Lints the rides.v1 contract (proto/) with `buf lint` and the repository's buf.yaml (STANDARD
# rules; the one waived rule and why are in buf.yaml). Fails on any finding. buf comes from npm
# (@bufbuild/buf, whose platform package carries the binary), pinned to BUF_VERSION and installed
# once into target/buf/ (git-ignored); npm itself from Debian's packages when it is missing.
# BUF=/path/to/buf uses another buf instead.
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

BUF_VERSION=1.75.0
prefix="$REPO_ROOT/target/buf"
buf="${BUF:-$prefix/node_modules/.bin/buf}"

# The pinned version, so that a newer buf's new rules never fail a build by surprise.
if [ -z "${BUF:-}" ] && [ "$("$buf" --version 2>/dev/null || true)" != "$BUF_VERSION" ]; then
  command -v npm >/dev/null || apt_install npm
  log "installing buf $BUF_VERSION from npm (@bufbuild/buf) into target/buf"
  npm install --no-audit --no-fund --loglevel=error --prefix "$prefix" "@bufbuild/buf@$BUF_VERSION" >/dev/null
fi

log "buf lint (proto/, buf.yaml)"
"$buf" lint
