"""Draws the panels of a Grafana dashboard (deploy/monitoring/dashboards/*.json) as PNG charts from
a live Prometheus: every target's `expr`, with the dashboard's variables set as live_check.py sets
them, queried over [--start, --end] by query_range, one line per series named by the target's
legendFormat, one PNG per row of the dashboard (its panels side by side). Grafana is not installable
here; these charts show what an on-call sees on the same queries.

Run by deploy/monitoring/charts.sh (which runs live-check.sh with a load run); needs matplotlib.

Usage: python3 charts.py --prometheus URL --start UNIX --end UNIX --out DIR DASHBOARD.json
"""

import argparse
import json
import math
import re
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from live_check import VARIABLES  # noqa: E402

UNITS = {"percentunit": ("%", 100.0), "s": ("seconds", 1.0), "reqps": ("calls/s", 1.0),
         "ops": ("per second", 1.0), "short": ("", 1.0)}


def query_range(base: str, expr: str, start: int, end: int, step: int) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(template: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or "value"


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def rows(dashboard: dict) -> list[tuple[str, list[dict]]]:
    """The dashboard's rows with their panels (a panel before any row goes in an untitled one)."""
    out: list[tuple[str, list[dict]]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.append((panel["title"], list(panel.get("panels", []))))
        elif out:
            out[-1][1].append(panel)
        else:
            out.append((dashboard["title"], [panel]))
    return [(title, panels) for title, panels in out if panels]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--start", type=int, required=True)
    parser.add_argument("--end", type=int, required=True)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("dashboard", type=Path)
    args = parser.parse_args()
    dashboard = json.loads(args.dashboard.read_text(encoding="utf-8"))
    args.out.mkdir(parents=True, exist_ok=True)
    empty: list[str] = []
    flat: list[str] = []
    for row_title, panels in rows(dashboard):
        columns = min(3, len(panels))
        lines = math.ceil(len(panels) / columns)
        figure, axes = plt.subplots(lines, columns, figsize=(5.5 * columns, 3.6 * lines),
                                    squeeze=False)
        for axis in axes.flat[len(panels):]:
            axis.set_visible(False)
        for axis, panel in zip(axes.flat, panels):
            unit, scale = UNITS.get(panel["fieldConfig"]["defaults"].get("unit", "short"), ("", 1.0))
            drawn = 0
            peak = 0.0
            for target in panel["targets"]:
                expr = target["expr"]
                for variable, value in VARIABLES.items():
                    expr = expr.replace(variable, value)
                for series in query_range(args.prometheus, expr, args.start, args.end, args.step):
                    points = [(float(t) - args.start, float(v) * scale) for t, v in series["values"]
                              if not math.isnan(float(v))]
                    if not points:
                        continue
                    axis.plot([t for t, _ in points], [v for _, v in points], linewidth=1.2,
                              label=legend(target.get("legendFormat", ""), series["metric"]))
                    drawn += 1
                    peak = max(peak, max(abs(v) for _, v in points))
            if drawn and not peak:
                flat.append(panel["title"])
            if not drawn:
                empty.append(panel["title"])
                axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
            axis.set_title(panel["title"], fontsize=10)
            axis.set_xlabel("seconds into the run", fontsize=8)
            axis.set_ylabel(unit, fontsize=8)
            axis.tick_params(labelsize=8)
            axis.grid(alpha=0.3)
            if drawn:
                axis.legend(fontsize=7, loc="best")
        figure.suptitle(row_title, fontsize=12)
        figure.tight_layout()
        path = args.out / f"{slug(row_title)}.png"
        figure.savefig(path, dpi=80)
        plt.close(figure)
        print(f"charts: {path}", file=sys.stderr)
    if empty:
        print(f"charts: panels with no data in the run: {', '.join(empty)}", file=sys.stderr)
    if flat:
        print(f"charts: panels at zero throughout the run: {', '.join(flat)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
