#!/usr/bin/env bash
# Draws the Grafana dashboard's panels (deploy/monitoring/dashboards/rocket-rides.json) as PNGs in
# docs/monitoring/ from a real run: deploy/monitoring/live-check.sh starts the processes and a
# Prometheus, checks every query, runs 15 minutes of load shaped like the production callers (a
# 10,000-rider pool, 64 calls in flight over one connection, the api-server at its defaults, a
# 250 ms provider) with the events of deploy/monitoring/chart-events.sh (aged keys, refused
# connections, keys the completer gives up, reconciliation findings, an operator's admin commands),
# then deploy/monitoring/charts.py queries that Prometheus. matplotlib (PyPI) lives in
# target/charts-venv, installed on the first run.
# Usage: deploy/monitoring/charts.sh   (about 17 minutes after the build; LIVE_CHECK_CHARTS_SECS,
# LIVE_CHECK_CHARTS_RIDERS and LIVE_CHECK_PROVIDER_LATENCY_MS change the run)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/target/charts-venv"
if ! "$VENV/bin/python" -c 'import matplotlib, yaml' 2>/dev/null; then
  if ! python3 -c 'import ensurepip' 2>/dev/null; then
    sudo=(); [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  fi
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q matplotlib==3.10.7 PyYAML==6.0.3
fi
CHARTS_PYTHON="$VENV/bin/python" LIVE_CHECK_CHARTS="$ROOT/docs/monitoring" \
  LIVE_CHECK_PROVIDER_LATENCY_MS="${LIVE_CHECK_PROVIDER_LATENCY_MS:-250}" \
  "$ROOT/deploy/monitoring/live-check.sh"
