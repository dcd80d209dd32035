#!/usr/bin/env bash
# Writes the generated copies of the rule files (deploy/monitoring/rules, the one source), or with
# --check fails when a copy differs from what it would write:
#
#   - deploy/monitoring/prometheus/rules/<file>: the plain Prometheus rule file, for a Prometheus
#     configured by file (deploy/compose.yaml's, deploy/monitoring/live-check.sh's, the promtool
#     tests of deploy/monitoring/tests);
#   - deploy/k8s/...prometheusrule*.yaml: the same groups under `spec:` of a PrometheusRule, for the
#     Prometheus Operator, which loads one whose labels match its ruleSelector (docs/runbooks.md,
#     "Loading the rules"; the label comes from deploy/k8s/components/prometheus-release).
#
# Both are the rule file's groups text for text (comments included), with the header comment
# replaced by one naming the source, and every `runbook_url: docs/runbooks.md#…` made absolute
# with the base URL of deploy/monitoring/runbook-base-url (the one setting; see that file).
#
# Usage: deploy/monitoring/render-prometheusrule.sh [--check]
# The rendering functions run through emit's "$@", which shellcheck does not follow.
# shellcheck disable=SC2317,SC2329
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

# rule file | PrometheusRule name | Kubernetes copy
TARGETS=(
  "rocket-rides.rules.yaml|rocket-rides|deploy/k8s/base/prometheusrule.yaml"
  "rocket-rides-kubernetes.rules.yaml|rocket-rides-kubernetes|deploy/k8s/base/prometheusrule-kubernetes.yaml"
  "rocket-rides-ha.rules.yaml|rocket-rides-ha|deploy/k8s/overlays/ha/prometheusrule.yaml"
)
PLAIN_DIR=deploy/monitoring/prometheus/rules

RUNBOOK_BASE_URL=$(grep -v '^#' deploy/monitoring/runbook-base-url | grep -m1 .)
case "$RUNBOOK_BASE_URL" in
  http://*/ | https://*/) ;;
  *) echo "deploy/monitoring/runbook-base-url: '$RUNBOOK_BASE_URL' is not an http(s) URL ending in /" >&2; exit 1 ;;
esac

groups() { # rule-file: its groups, runbook URLs made absolute
  local source=$1
  if ! grep -q '^groups:$' "$source"; then
    echo "$source: no top-level 'groups:' line" >&2
    return 1
  fi
  if grep -E 'runbook_url:' "$source" | grep -vqE 'runbook_url: docs/runbooks\.md#[a-z0-9-]+$'; then
    echo "$source: a runbook_url is not docs/runbooks.md#<anchor>" >&2
    return 1
  fi
  sed -n '/^groups:$/,$p' "$source" |
    sed -E "s|runbook_url: docs/runbooks\.md#|runbook_url: ${RUNBOOK_BASE_URL//|/\\|}docs/runbooks.md#|"
}

header() { # source
  cat <<EOF2
# GENERATED from $1
# by deploy/monitoring/render-prometheusrule.sh: edit the rule file and rerun the script
# (deploy/monitoring/test.sh fails when this copy differs).
EOF2
}

plain() { # source
  header "$1"
  groups "$1"
}

prometheusrule() { # source name
  header "$1"
  cat <<EOF2
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: $2
  labels:
    app.kubernetes.io/name: $2
    app.kubernetes.io/component: monitoring
spec:
EOF2
  # Indented under spec (blank lines stay blank for yamllint).
  groups "$1" | sed -E 's/^(.+)$/  \1/'
}

check=0
[ "${1:-}" = --check ] && check=1
status=0
emit() { # copy command...
  local copy=$1; shift
  if [ "$check" = 1 ]; then
    if ! diff -u "$copy" <("$@") >&2; then
      echo "$copy differs from its rule file: run deploy/monitoring/render-prometheusrule.sh" >&2
      status=1
    fi
  else
    "$@" >"$copy"
    echo "wrote $copy" >&2
  fi
}
mkdir -p "$PLAIN_DIR"
for target in "${TARGETS[@]}"; do
  IFS='|' read -r file name copy <<<"$target"
  source="deploy/monitoring/rules/$file"
  emit "$PLAIN_DIR/$file" plain "$source"
  emit "$copy" prometheusrule "$source" "$name"
done
exit "$status"
