"""The Grafana dashboard, generated from code so that it cannot drift from the metric
table: every metric a panel queries is checked against ``METRICS`` when the dashboard is
built, and ``dashboards/trainwatch.json`` is this module's output (a test compares them).

    python -m sidecar.dashboard > dashboards/trainwatch.json

Design: the data source is a variable (``datasource``), and so are ``instance`` (one per
node's daemon: Prometheus is where nodes meet), ``job`` (trainwatch's job key, the run id
when set, so one job across nodes is one value) and ``rank``. Headroom comes first: what
is left under the binding cgroup limit and on the host. Deaths are annotations (their time
is the series' value, exact to the sample) and a table sorted by time, across all nodes,
so a job's first death is the first row.

The scrape job must keep trainwatch's own ``job`` label (``honor_labels: true``), which
``deploy/prometheus/prometheus.yml`` does; otherwise Prometheus renames it ``exported_job``.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from sidecar.dashboard.panels import ANNOTATION, DS, VARIABLES, Panel, Target, panels
from sidecar.metrics.table import METRICS

__all__ = ["VARIABLES", "Panel", "Target", "all_queries", "build", "main", "metric_names", "panels"]


def all_queries() -> list[tuple[str, Target, str]]:
    """(panel title, target, needs) for every query of the dashboard, annotations included."""
    out = [(p.title, t, p.needs) for p in panels() for t in p.targets]
    out.append(("annotation: rank deaths", ANNOTATION, ""))
    return out


_NAME = re.compile(r"\b(trainwatch_[a-z_]+)\b")


def metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def _thresholds(steps: list[tuple[str, float | None]]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def _overrides(extra: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, dash in (("dashed", [10, 10]), ("dotted", [0, 10])):
        if key in extra:
            out.append(
                {
                    "matcher": {"id": "byRegexp", "options": f".*{extra[key]}"},
                    "properties": [
                        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": dash}},
                        {"id": "custom.fillOpacity", "value": 0},
                    ],
                }
            )
    if "rightAxisBytes" in extra:  # a series in bytes beside counts: its own axis, on the right
        out.append(
            {
                "matcher": {"id": "byRegexp", "options": f".*{extra['rightAxisBytes']}"},
                "properties": [
                    {"id": "custom.axisPlacement", "value": "right"},
                    {"id": "unit", "value": "bytes"},
                ],
            }
        )
    return out


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    if p.kind == "row":
        return {
            "type": "row",
            "id": pid,
            "title": p.title,
            "collapsed": False,
            "panels": [],
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        }
    targets = []
    for i, t in enumerate(p.targets):
        target: dict[str, Any] = {
            "refId": chr(ord("A") + i),
            "datasource": DS,
            "expr": t.expr,
            "legendFormat": t.legend or "__auto",
            "range": not t.instant,
            "instant": t.instant,
        }
        if t.table:
            target["format"] = "table"
        targets.append(target)
    defaults: dict[str, Any] = {"unit": p.unit} if p.unit else {}
    if "thresholds" in p.extra:
        defaults["thresholds"] = _thresholds(p.extra["thresholds"])
        defaults["color"] = {"mode": "thresholds"}
    if "noValue" in p.extra:
        defaults["noValue"] = p.extra["noValue"]
    if "links" in p.extra:
        defaults["links"] = p.extra["links"]
    options: dict[str, Any] = {}
    transformations: list[dict[str, Any]] = []
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "bars" if p.extra.get("bars") else "line",
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
        }
        options = {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    elif p.kind == "stat":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
            "textMode": "value_and_name",
        }
    elif p.kind == "barchart":
        options = {
            "xField": p.extra.get("xField", ""),
            "orientation": "auto",
            "showValue": "auto",
            "legend": {"showLegend": False, "displayMode": "list", "placement": "bottom"},
        }
        transformations = [{"id": "organize", "options": {"excludeByName": {"Time": True}}}]
    elif p.kind == "state-timeline":
        options = {"showValue": "auto", "mergeValues": True, "legend": {"showLegend": False}}
    elif p.kind == "table":
        options = {"showHeader": True, "sortBy": [{"displayName": "died at", "desc": False}]}
        transformations = [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "__name__": True},
                    "indexByName": {
                        "Value": 0,
                        "instance": 1,
                        "job": 2,
                        "rank": 3,
                        "restart": 4,
                        "killer": 5,
                    },
                    "renameByName": {"Value": "died at"},
                },
            },
        ]
        defaults["custom"] = {"align": "auto"}
    body: dict[str, Any] = {
        "type": p.kind,
        "id": pid,
        "title": p.title,
        "datasource": DS,
        "gridPos": {"h": p.h, "w": p.w, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": _overrides(p.extra)},
        "options": options,
    }
    if p.extra.get("table_time"):
        body["fieldConfig"]["overrides"].append(
            {
                "matcher": {"id": "byName", "options": "died at"},
                "properties": [{"id": "unit", "value": "dateTimeAsIso"}],
            }
        )
    if p.extra.get("job_link"):
        body["fieldConfig"]["overrides"].append(
            {
                "matcher": {"id": "byName", "options": "job"},
                "properties": [{"id": "links", "value": [p.extra["job_link"]]}],
            }
        )
    if p.description:
        body["description"] = p.description
    if transformations:
        body["transformations"] = transformations
    return body


def _variable(name: str, query: str, label: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"var-{name}", "qryType": 1},
        "refresh": 2,  # on time range change: jobs that ended in the range stay selectable
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 3 if name == "rank" else 1,
        "hide": 0,
        "options": [],
        "regex": "",
    }


def build() -> dict[str, Any]:
    """The dashboard as Grafana imports it. Raises ValueError when a panel queries a metric
    that the metric table does not have."""
    for title, target, _ in all_queries():
        unknown = metric_names(target.expr) - set(METRICS)
        if unknown:
            raise ValueError(f"panel {title!r} queries unknown metrics: {sorted(unknown)}")
    out, pid, x, y, row_h = [], 1, 0, 0, 0
    for p in panels():
        if p.kind == "row" or x + p.w > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append(_panel_json(p, pid, x, y))
        pid += 1
        if p.kind == "row":
            y += 1
        else:
            x, row_h = x + p.w, max(row_h, p.h)
    variables = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "refresh": 1,
            "hide": 0,
            "current": {},
            "options": [],
            "regex": "",
        },
        _variable("instance", VARIABLES["instance"], "Node"),
        _variable("job", VARIABLES["job"], "Job"),
        _variable("rank", VARIABLES["rank"], "Rank"),
        {
            # where the dashboard's story links go: a daemon started with --prometheus URL
            "name": "story_url",
            "label": "Stories from",
            "type": "textbox",
            "query": "http://localhost:9864",
            "current": {"text": "http://localhost:9864", "value": "http://localhost:9864"},
            "description": "A trainwatch daemon started with --prometheus (GET /story): the first-death "
            "panel and the deaths table link each job to its story across nodes there.",
            "hide": 0,
            "options": [],
        },
    ]
    return {
        "title": "trainwatch",
        "uid": "trainwatch",
        "description": "torchrun jobs: per-rank host and GPU memory against the limits, and rank "
        "deaths with the killer named (trainwatch)",
        "tags": ["trainwatch", "pytorch", "torchrun"],
        "timezone": "",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                {
                    "name": "Rank deaths",
                    "datasource": DS,
                    "enable": True,
                    "iconColor": "red",
                    "expr": ANNOTATION.expr,
                    "step": "10s",
                    "useValueForTime": True,
                    "titleFormat": "rank {{rank}} killed: {{killer}}",
                    "textFormat": "job {{job}} on {{instance}} (restart {{restart}}): GET /postmortems there",
                    "tagKeys": "killer,job,instance",
                },
            ]
        },
        "templating": {"list": variables},
        "panels": out,
    }


def main() -> None:
    json.dump(build(), sys.stdout, indent=2)
    sys.stdout.write("\n")
