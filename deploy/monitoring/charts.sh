#!/usr/bin/env bash
# Draws the Grafana dashboard's panels (deploy/monitoring/dashboards/rocket-rides.json) as PNGs in
# docs/monitoring/ from a real run: deploy/monitoring/live-check.sh starts the processes and a
# Prometheus, checks every query, runs a minute of load, then deploy/monitoring/charts.py queries
# that Prometheus. matplotlib (PyPI) lives in target/charts-venv, installed on the first run.
# Usage: deploy/monitoring/charts.sh   (about three minutes after the build)
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
  "$ROOT/deploy/monitoring/live-check.sh"
