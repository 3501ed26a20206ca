"""One story across nodes, for real: two torchrun agents on this machine form one job
(``--nnodes=2``, one c10d rendezvous on loopback, one gloo world of 4), each watched by its
own daemon (``--pid AGENT``: a node each), both scraped by a real Prometheus. A rank on
node B grows past node B's memory cgroup and the kernel kills it; node A's ranks fail in
their next collective. ``trainwatch story`` (the CLI) and ``GET /story`` (a third daemon
started with ``--prometheus``) must name node B's rank first (cgroup_oom), node A's ranks
as what followed, and every rank with a fate. Then the same with node A's daemon stopped
before the death: the story says so in ``gaps`` and still names the first death."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from sidecar.demo import join_cgroup, memory_cgroup
from sidecar.story.gather import gather
from sidecar.story.prom import Prometheus
from tests.e2e import REPO, DaemonProc, TorchrunJob, free_port, job_postmortem, wait_for
from tests.prom import PrometheusServer
from tests.skips import requires

GIB = 1 << 30
pytestmark = [pytest.mark.slow]


def story_cli(prom: PrometheusServer, job: str, fmt: str = "json") -> tuple[int, str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "story", "--prometheus", prom.base, "--job", job, "--format", fmt],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    return out.returncode, out.stdout, out.stderr


def deaths_in_prometheus(prom: PrometheusServer, job: str) -> dict[str, set[str]]:
    """instance -> the ranks whose death Prometheus holds for ``job``."""
    got: dict[str, set[str]] = {}
    q = f'last_over_time(trainwatch_rank_death_timestamp_seconds{{job="{job}"}}[10m])'
    for s in prom.api("query", query=q)["result"]:
        got.setdefault(s["metric"]["instance"], set()).add(s["metric"]["rank"])
    return got


@pytest.mark.root
@requires("prometheus", "memcg")
@pytest.mark.parametrize("node_a_daemon", ["running", "stopped"])
def test_story_names_node_b_first_across_two_nodes(tmp_path: Path, node_a_daemon: str) -> None:
    run_id = f"story-{uuid.uuid4().hex[:8]}"
    endpoint = f"127.0.0.1:{free_port()}"
    grow = tmp_path / "grow"
    common: dict[str, Any] = dict(
        nproc=2, nnodes=2, rdzv_id=run_id, rdzv_endpoint=endpoint, hold_mb=50, workers=1,
        grow_file=grow, grow_after=0, grow_mb=8, grow_interval=0.05,
    )  # fmt: skip
    with (
        memory_cgroup(int(1.5 * GIB), "trainwatch-story") as (_version, _parent, child),
        TorchrunJob(tmp_path, "node-a", rdzv_host=True, **common) as job_a,
        TorchrunJob(
            tmp_path, "node-b", wrap=join_cgroup(child), env={"TW_GROW_LOCAL_RANK": "0"}, **common
        ) as job_b,
        DaemonProc(tmp_path / "a", "--pid", str(job_a.agent_pid), interval=0.5) as daemon_a,
        DaemonProc(tmp_path / "b", "--pid", str(job_b.agent_pid), interval=0.5) as daemon_b,
    ):
        inst_a, inst_b = daemon_a.base.removeprefix("http://"), daemon_b.base.removeprefix("http://")
        ranks_a, ranks_b = job_a.ready(), job_b.ready()
        assert sorted([*ranks_a, *ranks_b]) == [0, 1, 2, 3], (ranks_a, ranks_b)
        victim = min(ranks_b)  # node B's local rank 0 grows
        daemon_a.wait_sampled(job_a, ranks_a)
        daemon_b.wait_sampled(job_b, ranks_b)
        with PrometheusServer(tmp_path, inst_a, inst_b) as prom:

            def both_nodes_ranks() -> bool:
                q = f'count by (instance) (trainwatch_rank_info{{job="{run_id}"}})'
                counts = {
                    s["metric"]["instance"]: s["value"][1] for s in prom.api("query", query=q)["result"]
                }
                return counts == {inst_a: "2", inst_b: "2"}

            wait_for(both_nodes_ranks, 60, "prometheus to hold both nodes' ranks of the job", 0.5)
            if node_a_daemon == "stopped":
                daemon_a.stop()
                wait_for(
                    lambda: prom.target_health().count("down") == 1, 30, "prometheus to see node A down", 0.5
                )
            grow.touch()
            doc_b = job_postmortem(daemon_b, victim_rank=victim, want_fates=2, job=job_b)
            assert doc_b["killer"]["kind"] == "cgroup_oom", doc_b["killer"]
            job_a.proc.wait(120)
            job_b.proc.wait(120)
            if node_a_daemon == "running":
                job_postmortem(daemon_a, victim_rank=None, want_fates=2, job=job_a)
            want = {inst_b: {str(r) for r in ranks_b}}
            if node_a_daemon == "running":
                want[inst_a] = {str(r) for r in ranks_a}
            wait_for(
                lambda: deaths_in_prometheus(prom, run_id) == want, 60, "prometheus to hold the deaths", 0.5
            )

            rc, out, err = story_cli(prom, run_id)
            assert rc == 0, err
            story = json.loads(out)
            (tmp_path / "story.json").write_text(out)  # kept with the test's files when it fails
            seen = gather(Prometheus(prom.base), run_id)
            (tmp_path / "seen.json").write_text(json.dumps(seen.as_dict(), indent=1))
            assert story["schema"] == "trainwatch.story/v1"
            assert story["job"] == run_id
            first = story["first_death"]
            assert (first["instance"], first["rank"]) == (inst_b, victim), story
            assert first["killer"]["kind"] == "cgroup_oom"
            assert first["killer"] == doc_b["killer"], "the node postmortem's killer, unchanged"
            assert first["pid"] == ranks_b[victim][0]
            assert first["postmortem"] == doc_b["id"]
            fates = {(r["instance"], r["rank"]): r for r in story["ranks"]}
            assert set(fates) == {(inst_a, r) for r in ranks_a} | {(inst_b, r) for r in ranks_b}, fates
            assert fates[(inst_b, victim)]["fate"] == "root_cause"
            other_b = max(ranks_b)
            assert fates[(inst_b, other_b)]["fate"] in ("terminated_by_agent", "collective_failure"), fates
            clock = {c["instance"]: c for c in story["clock"]}
            nodes = {n["instance"]: n for n in story["nodes"]}
            assert nodes[inst_b]["reachable"] and doc_b["id"] in nodes[inst_b]["postmortems"]
            # one machine, one clock: each node's bounded offset holds zero
            b_off = clock[inst_b]["offset_seconds"]
            assert b_off is not None and b_off["low"] <= 0 <= b_off["high"], clock
            chain = [e for e in story["chain"] if e["event"] == "death"]
            assert (chain[0]["instance"], chain[0]["rank"]) == (inst_b, victim), chain
            if node_a_daemon == "running":
                for (
                    r
                ) in ranks_a:  # node A's ranks followed: their collective failed, or their agent ended them
                    assert fates[(inst_a, r)]["fate"] in ("collective_failure", "terminated_by_agent"), fates
                    assert fates[(inst_a, r)]["died"] is not None
                assert nodes[inst_a]["reachable"]
                a_off = clock[inst_a]["offset_seconds"]
                assert a_off is not None and a_off["low"] <= 0 <= a_off["high"], clock
                assert {e["instance"] for e in chain} == {inst_a, inst_b}
                assert not any("could not be read" in g for g in story["gaps"]), story["gaps"]
            else:
                for r in ranks_a:
                    assert fates[(inst_a, r)]["fate"] == "unknown", fates
                assert not nodes[inst_a]["reachable"]
                gaps = " ".join(story["gaps"])
                assert inst_a in gaps and "could not be read" in gaps and "before the first death" in gaps, (
                    gaps
                )

            # the same story served by a daemon started with --prometheus (a viewer of no job)
            idle = subprocess.Popen(["sleep", "300"])
            try:
                with DaemonProc(tmp_path / "c", "--pid", str(idle.pid), "--prometheus", prom.base) as viewer:
                    status, body = viewer.get(f"/story?job={run_id}")
                    assert status == 200, body
                    served = json.loads(body)
                    # the same death (its time moves within its bound as newer scrapes bound the clock)
                    same = ("instance", "rank", "pid", "killer", "postmortem")
                    assert {k: served["first_death"][k] for k in same} == {k: first[k] for k in same}
                    assert [(r["instance"], r["rank"], r["fate"]) for r in served["ranks"]] == [
                        (r["instance"], r["rank"], r["fate"]) for r in story["ranks"]
                    ]
                    status, page = viewer.get(f"/story?job={run_id}&format=html")
                    assert status == 200 and "<svg" in page and inst_b in page
                    status, text = viewer.get(f"/story?job={run_id}&format=text")
                    assert status == 200 and f"First death: rank {victim} on" in text
                    status, body = viewer.get("/story?job=no-such-job")
                    assert status == 404 and "no death" in json.loads(body)["detail"]
            finally:
                idle.kill()
                idle.wait()
            rc, text, err = story_cli(prom, run_id, "text")
            assert rc == 0 and "cgroup_oom" in text, err
