#!/usr/bin/env bash
# Tests the Prometheus rules of deploy/monitoring/rules, and fails on any failure:
#
#   1. promtool check rules: syntax, PromQL, templates (the rule files and their generated plain
#      copies), and promtool check config on compose's Prometheus (deploy/monitoring/prometheus)
#   2. promtool test rules deploy/monitoring/tests/*.yaml: every alert fires after its `for`,
#      resolves, and stays quiet on normal traffic; every recording rule computes what it should
#   3. deploy/monitoring/check_rules.py: runbook links resolve, every alert and severity is tested,
#      the numbers copied from the manifests still match them
#   4. the generated copies (plain rule files for Prometheus, Kubernetes PrometheusRules, with
#      absolute runbook URLs) equal what the rule files render to (render-prometheusrule.sh --check)
#   5. deploy/monitoring/live-check.sh: the metric and label names of the rules and of the Grafana
#      dashboard (deploy/monitoring/dashboards) against the real processes, scraped by a real
#      Prometheus with compose's configuration; the scrape alerts quiet, then seeing a stopped
#      process (builds the binaries, uses the local PostgreSQL and RabbitMQ;
#      about a minute after the build). MONITORING_LIVE=0 skips it (steps 1-4 are offline).
#
# promtool comes from Debian's `prometheus` package, installed here when absent (its service is
# disabled and stopped: only the binaries are wanted).
# Usage: deploy/monitoring/test.sh   (from anywhere; no arguments)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

log() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "need root to run: $* (install sudo or run as root)" >&2; exit 1; fi
}

if ! command -v promtool >/dev/null; then
  log "installing promtool (Debian package prometheus)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    prometheus >/dev/null
  # The package enables a Prometheus on :9090; nothing here wants it running.
  if command -v systemctl >/dev/null; then
    as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

PYTHON=python3
[ -x "$ROOT/.run/venv/bin/python" ] && PYTHON="$ROOT/.run/venv/bin/python"
if ! "$PYTHON" -c 'import yaml' 2>/dev/null; then
  echo "deploy/monitoring/test.sh needs PyYAML: run deploy/validate.sh once (it creates .run/venv)" >&2
  exit 1
fi

log "promtool check rules"
promtool check rules deploy/monitoring/rules/*.yaml deploy/monitoring/prometheus/rules/*.yaml
log "promtool check config (compose's Prometheus)"
promtool check config deploy/monitoring/prometheus/prometheus.yml
log "promtool test rules"
promtool test rules deploy/monitoring/tests/*.yaml
log "runbook links, test coverage, numbers copied from the manifests"
"$PYTHON" deploy/monitoring/check_rules.py
log "generated copies (Prometheus rule files, PrometheusRules) equal the rule files"
deploy/monitoring/render-prometheusrule.sh --check
if command -v shellcheck >/dev/null; then
  shellcheck -x deploy/monitoring/*.sh
fi
if [ "${MONITORING_LIVE:-1}" != 0 ]; then
  log "deploy/monitoring/live-check.sh (the rules' names against a live scrape)"
  deploy/monitoring/live-check.sh
fi
echo "deploy/monitoring/test.sh: every check passed" >&2
