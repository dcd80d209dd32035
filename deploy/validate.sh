#!/usr/bin/env bash
# Validates everything under deploy/ offline and exits non-zero on any problem:
#
#   1. yamllint --strict (deploy/.yamllint) on every YAML file under deploy/
#   2. the Compose file against the Compose Specification's JSON schema (check-jsonschema's
#      bundled copy), then its references (deploy/validate.py compose: also every TLS file a
#      variable names is in a mounted volume, and a TLS api-server's healthcheck is
#      `api-server health-check`); `docker compose config` as well when a Compose plugin is
#      installed
#   3. the OpenTelemetry Collector config's pipelines
#   4. the Dockerfile (every workspace member copied, runtime targets non-root) and .dockerignore
#   5. kustomize: the base and every overlay rendered by deploy/validate.py (the subset of
#      kustomize used here) and, when kubectl is installed, by `kubectl kustomize` too; the two
#      renderings must agree object for object
#   6. the rendered manifests against Kubernetes' OpenAPI schemas, strictly (kubernetes-validate
#      ships them), for the oldest and newest versions we support; custom resources (the
#      operators' PostgreSQL and RabbitMQ clusters, cert-manager's Certificates and Issuers),
#      which kubernetes-validate only warns about, against the JSON schemas vendored in
#      deploy/schemas (deploy/validate.py custom-resources; a custom resource without one fails)
#   7. the project's rules on the rendered overlays (non-root, read-only root filesystem, no
#      capabilities, requests and limits, the api-server's exec probes running
#      `api-server health-check`, Forbid CronJobs, secret refs resolve) and TLS on every hop:
#      every PEM file a process reads is in a read-only Secret volume of a Secret that a
#      Certificate of the rendering (or an operator it runs) makes, no CA key is mounted, every
#      Certificate's issuer is in the rendering, server certificates name their Services, the
#      completer uses https:// with a client certificate, and every peer the rendering runs is
#      reached over verified TLS; every `metrics` port is scraped by a ServiceMonitor or PodMonitor,
#      and every monitoring.coreos.com object carries the same `release` label
#
# Python tools live in .run/venv (git-ignored), installed from PyPI on the first run only.
# Usage: deploy/validate.sh        (from anywhere; no arguments)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.run/venv"
WORK="$ROOT/.run/deploy-validate"
# Pinned so that a second run, CI and every developer check against the same rules and schemas.
REQUIREMENTS=(yamllint==1.38.0 kubernetes-validate==1.37.0 check-jsonschema==0.39.0)
# Oldest Kubernetes the manifests target, and the newest kubernetes-validate knows.
K8S_VERSIONS=(1.29.0 1.37.0)

log() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }
ok() { printf '  ok: %s\n' "$*" >&2; }
FAILURES=()
fail() { printf '\033[1;31m  FAILED:\033[0m %s\n' "$*" >&2; FAILURES+=("$*"); }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "need root to run: $* (install sudo or run as root)" >&2; exit 1; fi
}

ensure_venv() {
  local stamp="$VENV/.deploy-validate-requirements"
  if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "${REQUIREMENTS[*]}" ]; then
    return
  fi
  local python; python="$(command -v python3 || true)"
  [ -n "$python" ] || { echo "python3 is required" >&2; exit 1; }
  if [ ! -x "$VENV/bin/python" ]; then
    if ! "$python" -m venv --help >/dev/null 2>&1 || ! "$python" -c 'import ensurepip' 2>/dev/null; then
      log "installing python3-venv from Debian's packages"
      as_root apt-get update -qq
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    log "creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$python" -m venv "$VENV"
  fi
  log "installing ${REQUIREMENTS[*]} into $VENV (first run only)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${REQUIREMENTS[@]}"
  printf '%s' "${REQUIREMENTS[*]}" >"$stamp"
}

run_check() { # description command...
  local description=$1; shift
  local output
  if output="$("$@" 2>&1)"; then
    ok "$description"
  else
    [ -z "$output" ] || printf '%s\n' "$output" | sed 's/^/    /' >&2
    fail "$description"
  fi
}

ensure_venv
PY="$VENV/bin/python"
BIN="$VENV/bin"
rm -rf "$WORK"
mkdir -p "$WORK"
cd "$ROOT"

log "YAML lint"
mapfile -t YAML_FILES < <(find deploy -type f \( -name '*.yaml' -o -name '*.yml' \) | sort)
run_check "yamllint --strict on ${#YAML_FILES[@]} files" \
  "$BIN/yamllint" --strict -c deploy/.yamllint "${YAML_FILES[@]}"

log "Docker Compose"
run_check "deploy/compose.yaml matches the Compose Specification schema" \
  "$BIN/check-jsonschema" --builtin-schema vendor.compose-spec deploy/compose.yaml
run_check "deploy/compose.yaml references (depends_on, builds, volumes, healthchecks, ports, TLS files)" \
  "$PY" deploy/validate.py compose deploy/compose.yaml
if command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then
  run_check "docker compose config -q" docker compose -f deploy/compose.yaml config -q
else
  ok "docker compose config skipped (no Compose plugin installed)"
fi
run_check "deploy/otel-collector.yaml pipelines use defined components" \
  "$PY" deploy/validate.py collector deploy/otel-collector.yaml

log "Dockerfile"
run_check "deploy/Dockerfile and .dockerignore cover the workspace; runtime targets non-root" \
  "$PY" deploy/validate.py dockerfile deploy/Dockerfile "$ROOT"

log "Kubernetes"
KUBECTL_KUSTOMIZE=
if command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; then
  KUBECTL_KUSTOMIZE=1
fi
RENDERED=()
OVERLAYS=()
for dir in deploy/k8s/base deploy/k8s/overlays/*/; do
  dir="${dir%/}"
  name="$(echo "${dir#deploy/k8s/}" | tr '/' '-')"
  [[ "$dir" == */overlays/* ]] && OVERLAYS+=("$WORK/$name.yaml")
  if ! "$PY" deploy/validate.py render "$dir" >"$WORK/$name.py.yaml" 2>"$WORK/$name.err"; then
    sed 's/^/    /' "$WORK/$name.err" >&2
    fail "render $dir (deploy/validate.py)"
    continue
  fi
  if [ -n "$KUBECTL_KUSTOMIZE" ]; then
    if ! kubectl kustomize "$dir" >"$WORK/$name.yaml" 2>"$WORK/$name.err"; then
      sed 's/^/    /' "$WORK/$name.err" >&2
      fail "kubectl kustomize $dir"
      continue
    fi
    run_check "render $dir: kubectl kustomize and deploy/validate.py agree" \
      "$PY" deploy/validate.py same "$WORK/$name.yaml" "$WORK/$name.py.yaml"
  else
    cp "$WORK/$name.py.yaml" "$WORK/$name.yaml"
    ok "render $dir (deploy/validate.py; kubectl not installed)"
  fi
  RENDERED+=("$WORK/$name.yaml")
done
for version in "${K8S_VERSIONS[@]}"; do
  run_check "kubernetes-validate --strict, Kubernetes $version: ${#RENDERED[@]} renderings" \
    "$BIN/kubernetes-validate" --strict --quiet -k "$version" "${RENDERED[@]}"
done
# kubernetes-validate has no schema for a custom resource and only warns (hidden above, since the
# check passes): deploy/validate.py checks them against deploy/schemas, and fails on any without.
run_check "custom resources against deploy/schemas (minimal schemas: deploy/schemas/README.md)" \
  "$PY" deploy/validate.py custom-resources deploy/schemas "${RENDERED[@]}"
for overlay in "${OVERLAYS[@]}"; do
  [ -f "$overlay" ] || continue
  run_check "policy on $(basename "$overlay" .yaml): non-root, read-only, no caps, resources, probes, TLS, scraping" \
    "$PY" deploy/validate.py k8s-policy "$overlay"
done

if command -v shellcheck >/dev/null; then
  run_check "shellcheck deploy/validate.sh deploy/compose-certs.sh" \
    shellcheck deploy/validate.sh deploy/compose-certs.sh
fi

if [ ${#FAILURES[@]} -gt 0 ]; then
  printf '\033[1;31mdeploy/validate.sh: %d check(s) failed:\033[0m\n' "${#FAILURES[@]}" >&2
  printf '  - %s\n' "${FAILURES[@]}" >&2
  exit 1
fi
echo "deploy/validate.sh: every check passed (rendered manifests in ${WORK#"$ROOT"/})" >&2
