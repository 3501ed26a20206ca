"""The observability stack against the real Prometheus server: it scrapes a real daemon
attached to a real torchrun job (gloo, CPU) every second with the shipped scrape job and
rules; a rank is killed by a real memory cgroup limit; then every query of every panel of
the shipped dashboard (its variables substituted as Grafana would) must return series,
the variables must offer this job, and the rank-killed alert must fire."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from sidecar.dashboard import VARIABLES, all_queries
from sidecar.front.demo import join_cgroup, memory_cgroup
from tests.support.e2e import REPO, DaemonProc, TorchrunJob, job_postmortem, survivor_fate_right, wait_for
from tests.support.prom import PrometheusServer
from tests.support.skips import left_out, requires

GIB = 1 << 30


def grafana(expr: str, values: dict[str, str], range_s: int) -> str:
    """``expr`` with the dashboard's variables replaced as Grafana does for a regex
    matcher (each value regex-escaped, then escaped for a PromQL string)."""
    for name, value in values.items():
        escaped = value if value == ".*" else re.escape(value).replace("\\", "\\\\")
        expr = expr.replace(f"${name}", escaped)
    expr = expr.replace("$__rate_interval", "4s").replace("$__range", f"{range_s}s")
    assert "$" not in expr.replace('"$1"', ""), expr
    return expr


def label_values(prom: PrometheusServer, definition: str, start: float, end: float) -> set[str]:
    """Grafana's ``label_values(selector, label)`` through the series API."""
    m = re.fullmatch(r"label_values\((.+), (\w+)\)", definition)
    assert m, definition
    data = prom.api("series", **{"match[]": m[1], "start": f"{start:.0f}", "end": f"{end:.0f}"})
    return {s[m[2]] for s in data if m[2] in s}


@pytest.mark.root
@requires("prometheus", "memcg")
def test_every_panel_returns_series_and_the_killed_rank_alerts(tmp_path: Path) -> None:
    with (
        memory_cgroup(int(1.5 * GIB), "trainwatch-prom") as (_version, _parent, child),
        DaemonProc(tmp_path, interval=0.5) as daemon,
    ):
        instance = daemon.base.removeprefix("http://")
        with PrometheusServer(tmp_path, instance) as prom:
            wait_for(lambda: prom.target_health() == ["up"], 30, "prometheus to scrape the daemon", 0.5)
            start = time.time()
            with TorchrunJob(
                tmp_path,
                "prom",
                wrap=join_cgroup(child),
                hold_mb=50,
                workers=1,
                grow_rank=1,
                grow_after=8,
                grow_mb=4,  # 40 MB/s: long enough to be foreseen (the forecast panel and alert)
                grow_interval=0.1,
                gpu_mb=256 if Path("/dev/nvidiactl").exists() else 0,  # on a GPU machine, GPU panels too
            ) as job:
                pids = job.ready()
                doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
                job.proc.wait(60)
            assert doc["killer"]["kind"] == "cgroup_oom", doc["killer"]
            key = doc["job"]["key"]

            def killed() -> list[dict] | None:
                alerts = [
                    a
                    for a in prom.api("alerts")["alerts"]
                    if a["labels"]["alertname"] == "TrainwatchRankKilled" and a["labels"].get("job") == key
                ]
                return alerts if alerts and all(a["state"] == "firing" for a in alerts) else None

            alerts = wait_for(killed, 30, "TrainwatchRankKilled to fire", 0.5)
            # foreseen before: the forecast alert fired for rank 1 (and keeps firing a minute)
            soon = wait_for(
                lambda: prom.firing("TrainwatchRankMemoryExhaustionSoon", instance=instance),
                30,
                "TrainwatchRankMemoryExhaustionSoon to have fired",
                0.5,
            )
            assert {(a["labels"]["job"], a["labels"]["rank"]) for a in soon} == {(key, "1")}, soon
            # rank 0 alerts too where its gloo collective failed first for the killed peer: its
            # fate same_cause, counted under the OOM (the agent's teardown never alerts)
            survivor = next(r for r in doc["ranks"] if r["rank"] == 0)
            assert survivor_fate_right(survivor, job.output()), doc["ranks"]
            want = {"1", "0"} if survivor["fate"] == "same_cause" else {"1"}
            assert {a["labels"]["rank"] for a in alerts} == want, alerts
            (alert,) = [a for a in alerts if a["labels"]["rank"] == "1"]
            assert alert["labels"]["killer"] == "cgroup_oom" and alert["labels"]["rank"] == "1", alert
            assert alert["labels"]["instance"] == instance and alert["labels"]["severity"] == "critical"
            assert "cgroup_oom" in alert["annotations"]["summary"]
            # The kill shows in the OOM counters too (v1 memory.oom_control, /proc/vmstat).
            # Those rules live in another group, which Prometheus evaluates at its own phase
            # (a hash of the group's name and file): wait for each alert, do not read once.
            limited = doc["memory"]["cgroup"]["path"]
            for name in ("TrainwatchCgroupOomKills", "TrainwatchHostOomKills"):
                got = wait_for(lambda n=name: prom.firing(n, instance=instance), 30, f"{name} to fire", 0.5)
                if name == "TrainwatchCgroupOomKills":
                    assert any(a["labels"]["cgroup"].startswith(limited) for a in got), got

            end = time.time() + 1
            range_s = int(end - start) + 5
            has_gpu = bool(daemon.metrics().get("trainwatch_gpu_info"))
            values = {"instance": instance, "job": key, "rank": ".*"}

            # the variables offer this node, this job and its ranks
            assert instance in label_values(prom, VARIABLES["instance"], start, end)
            assert key in label_values(prom, grafana(VARIABLES["job"], values, range_s), start, end)
            assert {"0", "1"} <= label_values(prom, grafana(VARIABLES["rank"], values, range_s), start, end)

            report, empty = [], []
            for rank in (".*", "1"):
                values["rank"] = rank
                for title, target, needs in all_queries():
                    expr = grafana(target.expr, values, range_s)
                    result = prom.query(expr, end) if target.instant else prom.query_range(expr, start, end)
                    line = f"{title!r} rank={rank}: {len(result)} series  <- {expr}"
                    if not result and needs == "gpu" and not has_gpu:
                        left_out("gpu", f"GPU panel with series (the query is valid): {line}")
                    elif not result:
                        empty.append(line)
                    else:
                        report.append(f"ok: {line}")
            (tmp_path / "panels.txt").write_text("\n".join(report + empty) + "\n")
            print("\n".join(report))
            assert not empty, "panels without series:\n" + "\n".join(empty)

            # the death's time in the table and the annotation is the rank's own
            died = prom.query(
                f'trainwatch_rank_death_timestamp_seconds{{job="{key}", rank="1"}}',
                end,
            )
            assert died and died[0]["metric"]["killer"] == "cgroup_oom"
            assert float(died[0]["value"][1]) >= start and pids[1][0] == doc["victim"]["pid"]
            first = prom.query(f'trainwatch:job_first_death_timestamp_seconds{{job="{key}"}}', end)
            assert first and float(first[0]["value"][1]) == float(died[0]["value"][1])

            # the single-node case of `trainwatch story` is the same document with one node
            out = subprocess.run(
                [sys.executable, "-m", "sidecar", "story", "--prometheus", prom.base, "--format", "json"],
                capture_output=True, text=True, timeout=60, cwd=REPO,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            story = json.loads(out.stdout)
            assert story["job"] == key and [n["instance"] for n in story["nodes"]] == [instance]
            assert story["first_death"]["killer"]["kind"] == "cgroup_oom"
            assert (story["first_death"]["rank"], story["first_death"]["pid"]) == (1, doc["victim"]["pid"])
            assert {r["rank"]: r["fate"] for r in story["ranks"]} == {
                r["rank"]: r["fate"]
                for r in job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)["ranks"]
            }


def test_one_job_on_two_nodes_meets_in_prometheus(tmp_path: Path) -> None:
    """Two nodes of one job, as two daemons (two instances) each watching its own
    torchrun agent of the same run id. A rank dies on node A, then one on node B: the
    dashboard's first-death panel and the recording rule name A's time, the deaths table
    lists both nodes, and each node's death alerts with its own instance."""
    run_id = f"multinode-{os.getpid()}"
    with (
        TorchrunJob(tmp_path, "node-a", hold_mb=50, workers=0, rdzv_id=run_id) as job_a,
        TorchrunJob(tmp_path, "node-b", hold_mb=50, workers=0, rdzv_id=run_id) as job_b,
    ):
        pids_a, pids_b = job_a.ready(), job_b.ready()
        with (
            DaemonProc(tmp_path, "--pid", str(job_a.agent_pid)) as node_a,
            DaemonProc(tmp_path, "--pid", str(job_b.agent_pid)) as node_b,
        ):
            inst_a, inst_b = (d.base.removeprefix("http://") for d in (node_a, node_b))
            with PrometheusServer(tmp_path, inst_a, inst_b) as prom:
                wait_for(lambda: prom.target_health() == ["up", "up"], 30, "both nodes scraped", 0.5)
                start = time.time()
                wait_for(
                    lambda: prom.query(f'trainwatch_rank_info{{job="{run_id}"}}', time.time()),
                    30,
                    "the ranks in prometheus",
                    0.5,
                )
                os.kill(pids_a[1][0], signal.SIGKILL)
                doc_a = job_postmortem(node_a, victim_rank=1, want_fates=2, job=job_a)
                wait_for(
                    lambda: prom.query(
                        f'trainwatch_rank_death_timestamp_seconds{{instance="{inst_a}", job="{run_id}"}}',
                        time.time(),
                    ),
                    30,
                    "node A's death in prometheus before node B's",
                    0.5,
                )
                os.kill(pids_b[0][0], signal.SIGKILL)
                doc_b = job_postmortem(node_b, victim_rank=0, want_fates=2, job=job_b)
                assert doc_a["job"]["key"] == doc_b["job"]["key"] == run_id

                def both_alerting() -> set[str] | None:
                    got = {
                        a["labels"]["instance"]
                        for a in prom.api("alerts")["alerts"]
                        if a["labels"]["alertname"] == "TrainwatchRankKilled"
                        and a["labels"].get("job") == run_id
                        and a["state"] == "firing"
                    }
                    return got if got == {inst_a, inst_b} else None

                wait_for(both_alerting, 30, "TrainwatchRankKilled on both nodes", 0.5)
                end = time.time() + 1
                values = {"instance": ".*", "job": run_id, "rank": ".*"}
                (first_panel,) = [t for title, t, _ in all_queries() if title.startswith("First death")]
                (first,) = prom.query(grafana(first_panel.expr, values, int(end - start) + 5), end)
                died_a = datetime.fromisoformat(doc_a["victim"]["died_at"]).timestamp()
                died_b = datetime.fromisoformat(doc_b["victim"]["died_at"]).timestamp()
                assert died_a < died_b
                assert abs(float(first["value"][1]) / 1000 - died_a) < 0.01, (first, died_a)
                (rule,) = prom.query(f'trainwatch:job_first_death_timestamp_seconds{{job="{run_id}"}}', end)
                assert abs(float(rule["value"][1]) - died_a) < 0.01, (rule, died_a)
                # each node's survivor: SIGTERMed by its agent, or (its gloo collective failed
                # first for the killed peer) same_cause, counted under the victim's killer
                want = {(inst_a, "1", "external_signal"), (inst_b, "0", "external_signal")}
                for inst, doc, job, rank in ((inst_a, doc_a, job_a, 0), (inst_b, doc_b, job_b, 1)):
                    survivor = next(r for r in doc["ranks"] if r["rank"] == rank)
                    assert survivor_fate_right(survivor, job.output()), doc["ranks"]
                    by_agent = survivor["fate"] == "terminated_by_agent"
                    want.add((inst, str(rank), "agent_teardown" if by_agent else "external_signal"))
                (table,) = [t for title, t, _ in all_queries() if title == "Rank deaths"]

                def table_rows() -> list[dict] | None:  # once every death is scraped
                    now = time.time() + 1
                    rows = prom.query(grafana(table.expr, values, int(now - start) + 5), now)
                    return rows if len(rows) >= len(want) else None

                rows = wait_for(table_rows, 30, "every death in the deaths table", 0.5)
                by_node = {tuple(r["metric"][k] for k in ("instance", "rank", "killer")) for r in rows}
                assert by_node == want, by_node
                oldest = min(rows, key=lambda r: float(r["value"][1]))
                assert (oldest["metric"]["instance"], oldest["metric"]["rank"]) == (inst_a, "1")
