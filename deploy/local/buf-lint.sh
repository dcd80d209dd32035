#!/usr/bin/env bash
# Lints the rides.v1 contract (proto/) with `buf lint` and the repository's buf.yaml (STANDARD and
# COMMENTS rules; the one waived rule and why are in buf.yaml), then `buf breaking` against the last
# released contract, proto-released/ (FILE rules: nothing a client's generated code relies on may
# change). proto-released/ must be a version of proto/ that git's history holds (checked here, so
# the baseline cannot be edited by hand to let a break through); on a release, copy proto/ there
# (README.md, "The API contract"). Fails on any finding. buf comes from npm
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

# The baseline is a committed version of the contract: its bytes equal proto/'s at some commit.
released=proto-released/rides/v1/rides.proto
if [ "$(git rev-parse --is-shallow-repository 2>/dev/null || echo true)" = true ]; then
  log "skipping the check that $released is in git's history (no full history here)"
else
  want=$(git hash-object "$released") found=
  for commit in $(git log --format=%H -- proto/rides/v1/rides.proto); do
    if [ "$(git rev-parse "$commit:proto/rides/v1/rides.proto" 2>/dev/null)" = "$want" ]; then found=$commit; break; fi
  done
  [ -n "$found" ] || die "$released is no version of proto/rides/v1/rides.proto in git's history"
fi
log "buf breaking (proto/ against the released contract, proto-released/)"
"$buf" breaking --against proto-released
