"""Checks on deploy/monitoring that promtool does not make (run by deploy/monitoring/test.sh):

  - every alert's runbook_url points to a heading that exists in docs/runbooks.md, and is absolute
    in the generated copies (deploy/monitoring/prometheus/rules);
  - every alert's severity is warning or critical;
  - every alert, at each of its severities, fires in some promtool test (exp_alerts), and every
    alert has a test where it is expected quiet (`exp_alerts: []`);
  - the numbers the rules copy from the manifests (the PostgreSQL
    Cluster's instances) still match them.

Usage: python3 deploy/monitoring/check_rules.py   (from anywhere; exits 1 on any problem)
"""

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy/monitoring"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    anchor = heading.strip().lower()
    anchor = re.sub(r"[^\w\- ]", "", anchor)
    return anchor.replace(" ", "-")


def main() -> int:
    problems: list[str] = []
    anchors = {
        github_anchor(line.lstrip("#"))
        for line in (ROOT / "docs/runbooks.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    }

    alerts: dict[str, set[str]] = {}
    rule_text = ""
    for path in sorted((MONITORING / "rules").glob("*.yaml")):
        rule_text += path.read_text(encoding="utf-8")
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
            for rule in group["rules"]:
                if "alert" not in rule:
                    continue
                name = rule["alert"]
                severity = (rule.get("labels") or {}).get("severity")
                if severity not in ("warning", "critical"):
                    problems.append(f"{path.name}: {name}: severity {severity!r} is not warning or "
                                    "critical (the mixins' names)")
                alerts.setdefault(name, set()).add(severity)
                for key in ("summary", "description", "runbook_url"):
                    if not (rule.get("annotations") or {}).get(key):
                        problems.append(f"{path.name}: {name}: no {key} annotation")
                url = (rule.get("annotations") or {}).get("runbook_url", "")
                target, _, anchor = url.partition("#")
                if target != "docs/runbooks.md" or anchor not in anchors:
                    problems.append(f"{path.name}: {name}: runbook_url {url!r} names no heading of "
                                    "docs/runbooks.md")

    # The generated copies Prometheus loads carry absolute runbook URLs (render-prometheusrule.sh).
    for path in sorted((MONITORING / "prometheus/rules").glob("*.yaml")):
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
            for rule in group["rules"]:
                url = (rule.get("annotations") or {}).get("runbook_url", "")
                if "alert" in rule and not re.fullmatch(r"https?://[^\s#]+/docs/runbooks\.md#"
                                                        + re.escape(rule["alert"].lower()), url):
                    problems.append(f"prometheus/rules/{path.name}: {rule['alert']}: runbook_url "
                                    f"{url!r} is not <base URL>docs/runbooks.md#<alert in lower case>")

    fired: set[tuple[str, str]] = set()
    quiet: set[str] = set()
    for path in sorted((MONITORING / "tests").glob("*.yaml")):
        for test in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for case in test.get("alert_rule_test") or []:
                expected = case.get("exp_alerts") or []
                if not expected:
                    quiet.add(case["alertname"])
                for alert in expected:
                    fired.add((case["alertname"], alert["exp_labels"].get("severity")))
    for name, severities in sorted(alerts.items()):
        for severity in sorted(severities):
            if (name, severity) not in fired:
                problems.append(f"{name} ({severity}): no promtool test where it fires")
        if name not in quiet:
            problems.append(f"{name}: no promtool test where it stays quiet")

    cluster = (ROOT / "deploy/k8s/overlays/ha/postgres-cluster.yaml").read_text(encoding="utf-8")
    instances = re.search(r"^  instances: (\d+)$", cluster, re.MULTILINE)
    standbys = re.search(r"streaming_replicas:primary < (\d+)", rule_text)
    if not instances or not standbys or int(instances.group(1)) - 1 != int(standbys.group(1)):
        problems.append("RidesPostgresInstancesNotReady expects "
                        f"{standbys and standbys.group(1)} standbys, postgres-cluster.yaml has "
                        f"{instances and instances.group(1)} instances")

    for problem in problems:
        print(f"check_rules: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_rules: {len(alerts)} alerts: runbooks, tests and copied numbers agree",
              file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
