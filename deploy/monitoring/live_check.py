"""The assertions of deploy/monitoring/live-check.sh, against a Prometheus that scrapes the real
api-server and workers with compose's configuration and loads its rule file:

  - every metric name the rules read exists in what Prometheus scraped;
  - every label name the rules select, group or match on exists on the series they read;
  - every recording rule returns data, and no rule reports an evaluation error;
  - with --dashboard: every query of the Grafana dashboard (each panel's `expr`, the template
    variables' label_values) names only metrics and labels that exist and returns data, at least
    one sample of it a finite number (a ratio of nothing is NaN, which a panel draws as no data),
    with the dashboard's variables set as Grafana sets them for "All" ($namespace = .*,
    $__rate_interval = 1m);
  - with --config: every job of that Prometheus configuration has a target, and every target is up;
  - with --quiet ALERT: every expression of that alert returns nothing (the scrape alerts, on a
    healthy run: this proves their job names and labels match what is really scraped);
  - with --expect-firing ALERT --job JOB (after the caller stopped JOB's process): every expression
    of ALERT returns a series of that job, instead of the checks above.

Retries until --deadline-secs (counters appear only once the traffic has reached them), then
prints what is missing and exits 1.

Usage: python3 live_check.py --prometheus http://127.0.0.1:19090 --deadline-secs 90 \
           [--dashboard deploy/monitoring/dashboards/rocket-rides.json] [--config prometheus.yml] RULES.yaml
"""

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left",
            "group_right", "offset", "inf", "nan"}
GROUPING = r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


def names_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """Series names and label names in a PromQL expression (the subset of PromQL the rules use:
    selectors, grouping and matching clauses, ranges, offsets, function calls)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels: set[str] = set()
    for selector in re.finditer(r"\{([^}]*)\}", text):
        labels |= {m.group(1) for m in
                   re.finditer(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector.group(1))}
    text = re.sub(r"\{[^}]*\}", " ", text)
    for clause in re.finditer(GROUPING, text):
        labels |= {label.strip() for label in clause.group(2).split(",") if label.strip()}
    text = re.sub(GROUPING, " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+\S+", " ", text)
    names: set[str] = set()
    for token in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        if text[token.end():].lstrip().startswith("(") or token.group(0) in KEYWORDS:
            continue
        names.add(token.group(0))
    return names, labels


# What Grafana substitutes for the dashboard's variables when "All" namespaces are shown; the
# scrape interval here is 2 s, so one minute holds many samples.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$namespace": ".*"}


def dashboard_queries(dashboard: dict) -> list[dict]:
    """Every query of a Grafana dashboard as a pseudo-rule {"panel", "expr"}: each target's
    `expr` (rows' nested panels included) and each query variable's label_values(METRIC, LABEL),
    checked as the selector METRIC with LABEL grouped on."""
    queries: list[dict] = []

    def substitute(expr: str) -> str:
        for variable, value in VARIABLES.items():
            expr = expr.replace(variable, value)
        if "$" in expr:
            raise ValueError(f"dashboard query uses a variable live_check.py does not know: {expr}")
        return expr

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    queries.append({"panel": panel["title"], "expr": substitute(target["expr"])})
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*(\w+)\s*\)\s*", query)
        if not match:
            raise ValueError(f"variable {variable['name']}: only label_values(METRIC, LABEL) is checked")
        queries.append({"panel": f"variable {variable['name']}",
                        "expr": f"count by ({match.group(2)}) ({match.group(1)})"})
    return queries


def api(base: str, path: str, **params: str) -> object:
    url = f"{base}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {body}")
    return body["data"]


def finite(result: list[dict]) -> bool:
    """Some sample of an instant-query result is a finite number."""
    return any(math.isfinite(float(series["value"][1])) for series in result)


def problems_now(base: str, rules: list[dict], queries: list[dict] | None = None,
                 jobs: list[str] | None = None,
                 quiet: list[str] | None = None) -> tuple[list[str], int]:
    problems: list[str] = []
    scraped = set(api(base, "label/__name__/values"))
    recorded = {rule["record"] for rule in rules if "record" in rule}
    queries = queries or []
    label_cache: dict[str, set[str]] = {}

    def labels_of(name: str) -> set[str]:
        if name not in label_cache:
            series = api(base, "series", **{"match[]": name})
            label_cache[name] = {key for s in series for key in s}
        return label_cache[name]

    checked = 0
    for rule in rules + queries:
        what = rule.get("record") or rule.get("alert") or f"dashboard panel {rule['panel']!r}"
        names, labels = names_and_labels(rule["expr"])
        for name in sorted(names):
            checked += 1
            if ":" in name:
                if name not in recorded:
                    problems.append(f"{what}: reads {name}, which no rule records")
            elif name not in scraped:
                problems.append(f"{what}: reads {name}, which no process exports")
        available = set().union(*(labels_of(name) for name in names)) if names else set()
        for label in sorted(labels - available):
            problems.append(f"{what}: label {label} is on no series of {', '.join(sorted(names))}")

    for name in sorted(recorded):
        if not api(base, "query", query=name)["result"]:
            problems.append(f"recording rule {name} returns no data")

    for query in queries:
        result = api(base, "query", query=query["expr"])["result"]
        if not result:
            problems.append(f"dashboard panel {query['panel']!r}: {query['expr']} returns no data")
        elif not finite(result):
            problems.append(f"dashboard panel {query['panel']!r}: {query['expr']} returns only NaN "
                            "or infinite values")

    for rule in rules:
        if rule.get("alert") in (quiet or []):
            result = api(base, "query", query=rule["expr"])["result"]
            if result:
                problems.append(f"alert {rule['alert']} would fire on a healthy run: "
                                f"{[series['metric'] for series in result]}")

    for job in jobs or []:
        up = api(base, "query", query=f'up{{job="{job}"}}')["result"]
        if not up:
            problems.append(f"job {job}: no target")
        for series in up:
            if series["value"][1] != "1":
                problems.append(f"job {job}: target {series['metric'].get('instance')} is down")

    for group in api(base, "rules")["groups"]:
        for rule in group["rules"]:
            if rule.get("health") == "err":
                problems.append(f"{rule['name']}: evaluation error {rule.get('lastError')}")
    return problems, checked


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--deadline-secs", type=float, default=90)
    parser.add_argument("--dashboard", type=Path, action="append", default=[])
    parser.add_argument("--config", type=Path, help="the Prometheus configuration: its jobs must be up")
    parser.add_argument("--quiet", action="append", default=[], metavar="ALERT")
    parser.add_argument("--expect-firing", metavar="ALERT")
    parser.add_argument("--job")
    parser.add_argument("rules", type=Path)
    args = parser.parse_args()
    rules = [rule for group in yaml.safe_load(args.rules.read_text(encoding="utf-8"))["groups"]
             for rule in group["rules"]]
    queries = [query for path in args.dashboard
               for query in dashboard_queries(json.loads(path.read_text(encoding="utf-8")))]
    if args.expect_firing:
        return expect_firing(args, rules)
    for name in args.quiet:
        if not any(rule.get("alert") == name for rule in rules):
            print(f"live_check: --quiet {name}: no such alert", file=sys.stderr)
            return 1
    jobs = ([job["job_name"] for job in
             yaml.safe_load(args.config.read_text(encoding="utf-8"))["scrape_configs"]]
            if args.config else [])
    deadline = time.monotonic() + args.deadline_secs
    # The check must be able to fail: a rule reading a name nothing exports is reported.
    decoy = {"record": "live_check:decoy:absent", "expr": "rides_live_check_decoy_total"}
    decoy_problems, _ = problems_now(args.prometheus, [decoy])
    if not any("rides_live_check_decoy_total" in problem for problem in decoy_problems):
        print("live_check: a rule on a missing metric was not reported: the check is broken",
              file=sys.stderr)
        return 1
    # The same for a dashboard query: one on a missing metric, or one returning nothing, is reported.
    decoy_query = {"panel": "decoy", "expr": 'sum(rides_live_check_decoy_total{namespace=~".*"})'}
    decoy_problems, _ = problems_now(args.prometheus, [], [decoy_query])
    if not (any("which no process exports" in problem for problem in decoy_problems)
            and any("returns no data" in problem for problem in decoy_problems)):
        print("live_check: a dashboard query on a missing metric was not reported: the check is "
              "broken", file=sys.stderr)
        return 1
    while True:
        problems, checked = problems_now(args.prometheus, rules, queries, jobs, args.quiet)
        if not problems:
            records = sum(1 for rule in rules if "record" in rule)
            print(f"live_check: {len(rules)} rules and {len(queries)} dashboard queries, {checked} "
                  f"series names read by them: every name and label exists, all {records} "
                  f"recording rules and every dashboard query return data (finite values); "
                  f"{len(jobs)} jobs up", file=sys.stderr)
            return 0
        if time.monotonic() > deadline:
            for problem in problems:
                print(f"live_check: {problem}", file=sys.stderr)
            return 1
        time.sleep(3)


def expect_firing(args: argparse.Namespace, rules: list[dict]) -> int:
    exprs = [rule["expr"] for rule in rules if rule.get("alert") == args.expect_firing]
    if not exprs or not args.job:
        print(f"live_check: --expect-firing {args.expect_firing}: no such alert, or no --job",
              file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.deadline_secs
    while True:
        missing = [expr for expr in exprs
                   if not any(series["metric"].get("job") == args.job
                              for series in api(args.prometheus, "query", query=expr)["result"])]
        if not missing:
            print(f"live_check: with {args.job} stopped, all {len(exprs)} expressions of "
                  f"{args.expect_firing} return its series", file=sys.stderr)
            return 0
        if time.monotonic() > deadline:
            for expr in missing:
                print(f"live_check: {args.expect_firing}: {expr.strip()} returns no series of job "
                      f"{args.job}", file=sys.stderr)
            return 1
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
