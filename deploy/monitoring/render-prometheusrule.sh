#!/usr/bin/env bash
# Writes the Kubernetes PrometheusRule copies of the rule files (deploy/monitoring/rules), or with
# --check fails when a copy differs from what it would write. A copy is its rule file's groups,
# text for text (comments included), under `spec:` of a PrometheusRule; the rule file's header
# comment is replaced by one naming its source. The Prometheus Operator loads a PrometheusRule
# whose labels match its Prometheus's ruleSelector (docs/runbooks.md, "Loading the rules").
#
# Usage: deploy/monitoring/render-prometheusrule.sh [--check]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

# rule file | PrometheusRule name | copy
TARGETS=(
  "deploy/monitoring/rules/rocket-rides.rules.yaml|rocket-rides|deploy/k8s/base/prometheusrule.yaml"
  "deploy/monitoring/rules/rocket-rides-kubernetes.rules.yaml|rocket-rides-kubernetes|deploy/k8s/base/prometheusrule-kubernetes.yaml"
  "deploy/monitoring/rules/rocket-rides-ha.rules.yaml|rocket-rides-ha|deploy/k8s/overlays/ha/prometheusrule.yaml"
)

render() { # rule-file name
  local source=$1 name=$2
  if ! grep -q '^groups:$' "$source"; then
    echo "$source: no top-level 'groups:' line" >&2
    return 1
  fi
  cat <<EOF
# GENERATED from $source
# by deploy/monitoring/render-prometheusrule.sh: edit the rule file and rerun the script
# (deploy/monitoring/test.sh fails when this copy differs).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: $name
  labels:
    app.kubernetes.io/name: $name
    app.kubernetes.io/component: monitoring
spec:
EOF
  # From `groups:` on, indented under spec (blank lines stay blank for yamllint).
  sed -n '/^groups:$/,$p' "$source" | sed -E 's/^(.+)$/  \1/'
}

check=0
[ "${1:-}" = --check ] && check=1
status=0
for target in "${TARGETS[@]}"; do
  IFS='|' read -r source name copy <<<"$target"
  if [ "$check" = 1 ]; then
    if ! diff -u "$copy" <(render "$source" "$name") >&2; then
      echo "$copy differs from $source: run deploy/monitoring/render-prometheusrule.sh" >&2
      status=1
    fi
  else
    render "$source" "$name" >"$copy"
    echo "wrote $copy" >&2
  fi
done
exit "$status"
