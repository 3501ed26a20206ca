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
from dataclasses import dataclass, field
from typing import Any

from sidecar.metrics import METRICS

__all__ = ["Panel", "Target", "all_queries", "build", "metric_names", "panels"]

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL_NODE = 'instance=~"$instance"'
SEL_JOB = 'instance=~"$instance", job=~"$job"'
SEL_RANK = 'instance=~"$instance", job=~"$job", rank=~"$rank"'
DEATH_TIMES = "trainwatch_rank_death_timestamp_seconds"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | stat | table | barchart | state-timeline | row
    targets: tuple[Target, ...] = ()
    unit: str = ""
    description: str = ""
    w: int = 12
    h: int = 8
    needs: str = ""  # "gpu": returns series only on a machine with NVIDIA GPUs
    extra: dict[str, Any] = field(default_factory=dict)


def _row(title: str) -> Panel:
    return Panel(title, "row", w=24, h=1)


def panels() -> list[Panel]:
    """The dashboard's panels, top to bottom (rows start new sections)."""
    headroom_expr = (
        "min by (instance, job) (\n"
        f'  label_replace(trainwatch_rank_cgroup_info{{{SEL_JOB}, limited_by!=""}}, '
        '"cgroup", "$1", "limited_by", "(.+)")\n'
        "  * on (instance, cgroup) group_left ()\n"
        "  (trainwatch_cgroup_memory_limit_bytes - trainwatch_cgroup_memory_usage_bytes)\n)"
    )
    return [
        _row("Headroom"),
        Panel(
            "Headroom to the binding cgroup limit",
            "stat",
            (Target(headroom_expr, "{{job}} on {{instance}}"),),
            unit="bytes",
            w=6,
            h=5,
            description="Memory left under the tightest cgroup limit over the job's ranks (limit minus "
            "usage of the cgroup whose limit binds them). At 0 the kernel kills a process of that cgroup.",
            extra={"thresholds": [("red", None), ("orange", 2 << 30), ("green", 8 << 30)]},
        ),
        Panel(
            "Host memory available",
            "stat",
            (Target(f"trainwatch_host_memory_available_bytes{{{SEL_NODE}}}", "{{instance}}"),),
            unit="bytes",
            w=6,
            h=5,
            description="MemAvailable: what the node can still give before the kernel's OOM killer runs.",
            extra={"thresholds": [("red", None), ("orange", 4 << 30), ("green", 16 << 30)]},
        ),
        Panel(
            "Ranks killed",
            "stat",
            (
                Target(
                    f"count(max by (instance, job, rank, restart) (last_over_time({DEATH_TIMES}"
                    f'{{{SEL_JOB}, killer!="agent_teardown"}}[$__range])))',
                ),
            ),
            w=6,
            h=5,
            description="Ranks that died abnormally in the time range, the ones the agent stopped "
            "afterwards not counted. Each has a postmortem: GET /postmortems on its node.",
            extra={"thresholds": [("green", None), ("red", 1)], "noValue": "0"},
        ),
        Panel(
            "First death of the job (all nodes)",
            "stat",
            (
                Target(
                    f'min by (job) (last_over_time({DEATH_TIMES}{{job=~"$job"}}[$__range])) * 1000',
                    "{{job}}",
                ),
            ),
            unit="dateTimeAsIso",
            w=6,
            h=5,
            description="The earliest rank death of the job over every node's daemon: where to look first.",
        ),
        _row("Ranks"),
        Panel(
            "Rank memory against its limit",
            "timeseries",
            (
                Target(f"trainwatch_rank_tree_resident_memory_bytes{{{SEL_RANK}}}", "rank {{rank}} tree"),
                Target(f"trainwatch_rank_resident_memory_bytes{{{SEL_RANK}}}", "rank {{rank}}"),
                Target(f"trainwatch_rank_memory_limit_bytes{{{SEL_RANK}}}", "rank {{rank}} limit"),
                Target(f"trainwatch_host_memory_available_bytes{{{SEL_NODE}}}", "{{instance}} available"),
            ),
            unit="bytes",
            w=24,
            h=9,
            description="Each rank's resident memory, with its DataLoader workers (tree), against the "
            "tightest cgroup limit over its cgroup (dashed) and the host's available memory (dotted).",
            extra={"dashed": "limit$", "dotted": "available$"},
        ),
        Panel(
            "Rank peak RSS (VmHWM)",
            "barchart",
            (
                Target(
                    # over the range: the rank that died (whose series ended) is the one to see
                    "max by (instance, job, rank) (max_over_time("
                    f"trainwatch_rank_peak_resident_memory_bytes{{{SEL_RANK}}}[$__range]))",
                    "{{instance}} rank {{rank}}",
                    instant=True,
                    table=True,
                ),
            ),
            unit="bytes",
            w=8,
            description="The highest resident set each rank reached in the time range, dead ranks included.",
            extra={"xField": "rank"},
        ),
        Panel(
            "Rank CPU",
            "timeseries",
            (
                Target(
                    f"rate(trainwatch_rank_cpu_seconds_total{{{SEL_RANK}}}[$__rate_interval])",
                    "rank {{rank}}",
                ),
            ),
            unit="percentunit",
            w=8,
            description="CPU seconds per second of each rank process (1 = one core).",
        ),
        Panel(
            "Job stalled for",
            "timeseries",
            (Target(f"trainwatch_job_stalled_seconds{{{SEL_JOB}}}", "{{job}}"),),
            unit="s",
            w=8,
            description="How long no rank of the job has used CPU: a hang (a collective that never "
            "completes) shows as a ramp long before the NCCL timeout ends it.",
        ),
        Panel(
            "Processes per rank (DataLoader workers)",
            "timeseries",
            (Target(f"trainwatch_rank_tree_processes{{{SEL_RANK}}}", "rank {{rank}}"),),
            w=12,
            h=6,
        ),
        Panel(
            "Ranks and restarts",
            "timeseries",
            (
                Target(f"trainwatch_job_ranks{{{SEL_JOB}}}", "{{job}} live ranks"),
                Target(f"trainwatch_job_restarts{{{SEL_JOB}}}", "{{job}} restarts"),
            ),
            w=12,
            h=6,
        ),
        _row("Cgroups and host"),
        Panel(
            "Cgroup memory against its limit",
            "timeseries",
            (
                Target(f"trainwatch_cgroup_memory_usage_bytes{{{SEL_NODE}}}", "{{cgroup}} usage"),
                Target(f"trainwatch_cgroup_memory_limit_bytes{{{SEL_NODE}}}", "{{cgroup}} limit"),
            ),
            unit="bytes",
            description="The memory cgroups that hold ranks, and those whose limits bind them.",
            extra={"dashed": "limit$"},
        ),
        Panel(
            "Host memory",
            "timeseries",
            (
                Target(f"trainwatch_host_memory_available_bytes{{{SEL_NODE}}}", "{{instance}} available"),
                Target(f"trainwatch_host_memory_total_bytes{{{SEL_NODE}}}", "{{instance}} total"),
            ),
            unit="bytes",
            extra={"dashed": "total$"},
        ),
        Panel(
            "OOM kills",
            "timeseries",
            (
                Target(
                    f"increase(trainwatch_host_oom_kills_total{{{SEL_NODE}}}[$__rate_interval])",
                    "{{instance}} host (kernel)",
                ),
                Target(
                    f"increase(trainwatch_cgroup_oom_kills_total{{{SEL_NODE}}}[$__rate_interval])",
                    "{{cgroup}}",
                ),
            ),
            w=8,
            description="Processes killed by the kernel's OOM killer, on the whole node (/proc/vmstat) "
            "and in each cgroup that holds ranks.",
            extra={"bars": True},
        ),
        Panel(
            "Memory pressure",
            "timeseries",
            (Target(f"trainwatch_host_memory_pressure_ratio{{{SEL_NODE}}}", "{{instance}} {{kind}}"),),
            unit="percentunit",
            w=8,
            description="Share of the last 10 s in which some (or all) tasks waited on memory "
            "(/proc/pressure/memory): reclaim before an OOM.",
        ),
        Panel(
            "/dev/shm",
            "timeseries",
            (
                Target(f"trainwatch_host_shm_used_bytes{{{SEL_NODE}}}", "{{instance}} used"),
                Target(f"trainwatch_host_shm_size_bytes{{{SEL_NODE}}}", "{{instance}} size"),
            ),
            unit="bytes",
            w=8,
            description="DataLoader workers pass batches through /dev/shm; when it fills they die of SIGBUS.",
            extra={"dashed": "size$"},
        ),
        _row("GPUs"),
        Panel(
            "GPU memory per rank",
            "timeseries",
            (
                Target(
                    f"trainwatch_rank_gpu_memory_bytes{{{SEL_RANK}}}",
                    "rank {{rank}} on GPU {{gpu}}",
                ),
            ),
            unit="bytes",
            needs="gpu",
        ),
        Panel(
            "GPU memory per device",
            "timeseries",
            (
                Target(f"trainwatch_gpu_memory_used_bytes{{{SEL_NODE}}}", "{{instance}} GPU {{gpu}} used"),
                Target(f"trainwatch_gpu_memory_total_bytes{{{SEL_NODE}}}", "{{instance}} GPU {{gpu}} total"),
            ),
            unit="bytes",
            needs="gpu",
            extra={"dashed": "total$"},
        ),
        Panel(
            "GPUs lost",
            "state-timeline",
            (Target(f"trainwatch_gpu_lost{{{SEL_NODE}}}", "{{instance}} GPU {{gpu}}"),),
            w=24,
            h=4,
            needs="gpu",
            description="1 when NVML reports the GPU lost (fallen off the bus): the ranks on it die next.",
            extra={"thresholds": [("green", None), ("red", 1)]},
        ),
        _row("Deaths"),
        Panel(
            "Rank deaths",
            "table",
            (
                Target(
                    f"max by (instance, job, rank, restart, killer) "
                    f"(last_over_time({DEATH_TIMES}{{{SEL_JOB}}}[$__range])) * 1000",
                    instant=True,
                    table=True,
                ),
            ),
            w=16,
            description="Every rank death in the range, oldest first over all nodes: the first row is the "
            "job's first death. agent_teardown: stopped by the torchrun agent after another rank failed. "
            "The postmortem is at GET /postmortems on the node (instance).",
            extra={"table_time": True},
        ),
        Panel(
            "Deaths by killer",
            "barchart",
            (
                Target(
                    f"sum by (killer) (trainwatch_rank_deaths_total{{{SEL_JOB}}})",
                    "{{killer}}",
                    instant=True,
                    table=True,
                ),
            ),
            w=8,
            description="Rank deaths counted by the daemons since they started, by the killer named "
            "in the postmortem.",
            extra={"xField": "killer"},
        ),
        _row("trainwatch"),
        Panel(
            "Probe success",
            "state-timeline",
            (Target(f"trainwatch_probe_success{{{SEL_NODE}}}", "{{instance}} {{probe}}"),),
            w=12,
            description="1 when the probe's last run succeeded. gpu is 0 on nodes without an NVIDIA driver.",
            extra={"thresholds": [("red", None), ("green", 1)]},
        ),
        Panel(
            "Sample age",
            "timeseries",
            (
                Target(
                    f"time() - trainwatch_last_sample_timestamp_seconds{{{SEL_NODE}}}",
                    "{{instance}}",
                ),
            ),
            unit="s",
            w=6,
            description="Seconds since the last finished sampling round; above a few intervals the "
            "sampler is stalled.",
        ),
        Panel(
            "Sampling cost",
            "timeseries",
            (
                Target(f"trainwatch_sample_duration_seconds{{{SEL_NODE}}}", "{{instance}} round"),
                Target(
                    f"rate(trainwatch_sampler_overruns_total{{{SEL_NODE}}}[$__rate_interval])",
                    "{{instance}} overruns/s",
                ),
                Target(
                    f"trainwatch_probe_duration_seconds{{{SEL_NODE}}}",
                    "{{instance}} {{probe}}",
                ),
            ),
            unit="s",
            w=6,
        ),
    ]


ANNOTATION = Target(
    f"max by (instance, job, rank, restart, killer) "
    f'({DEATH_TIMES}{{{SEL_JOB}, killer!="agent_teardown"}}) * 1000'
)

VARIABLES = {
    "instance": "label_values(trainwatch_build_info, instance)",
    "job": 'label_values(trainwatch_job_info{instance=~"$instance"}, job)',
    "rank": 'label_values(trainwatch_rank_info{instance=~"$instance", job=~"$job"}, rank)',
}


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


if __name__ == "__main__":
    main()
