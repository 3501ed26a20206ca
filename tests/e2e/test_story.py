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
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup
from sidecar.story.gather import gather
from sidecar.story.prom import Prometheus
from tests.support import slurm
from tests.support.e2e import (
    REPO,
    DaemonProc,
    MpiJob,
    SlurmJob,
    TorchrunJob,
    free_port,
    job_postmortem,
    parent_pid,
    settled_postmortem,
    survivor_fate_right,
    wait_for,
)
from tests.support.prom import PrometheusServer
from tests.support.skips import requires

GIB = 1 << 30


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
            # node B's survivor: SIGTERMed by its agent, or its gloo collective failed first for
            # the killed peer (its node's same_cause, which the story keeps or calls the
            # collective's failure)
            row_b = next(r for r in doc_b["ranks"] if r["rank"] == other_b)
            assert survivor_fate_right(row_b, job_b.output()), doc_b["ranks"]
            told = {"terminated_by_agent", "collective_failure", row_b["fate"]}
            assert fates[(inst_b, other_b)]["fate"] in told, fates
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


@pytest.mark.root
@requires("prometheus", "memcg", "openmpi")
def test_story_of_an_mpi_job_names_node_b_first_by_its_job_id(tmp_path: Path) -> None:
    """Open MPI's job id (its ranks' PMIx namespace) is the same on every node, so each
    node's daemon labels the job alike and the story meets across them. Rank 1, on node B,
    grows past node B's memory cgroup; mpirun then aborts the job."""
    grow = tmp_path / "grow"
    with (
        memory_cgroup(int(1.5 * GIB), "trainwatch-story-mpi") as (_version, _parent, child),
        TwoNodeMpiJob(
            tmp_path, "mpi", child, hold_mb=50, workers=1,
            grow_rank=1, grow_file=grow, grow_after=0, grow_mb=8, grow_interval=0.05,
        ) as job,
    ):  # fmt: skip
        ranks = job.ready()
        assert parent_pid(ranks[0][0]) == job.proc.pid
        assert Path(f"/proc/{parent_pid(ranks[1][0])}/comm").read_text().strip() == "orted"
        story, _ = _two_node_story(tmp_path, job, ranks, grow, relayed=True)
    assert story["job"].isdigit(), story["job"]  # Open MPI's job id
    # rank 0 followed: its collective failed (its own last lines say so), or mpirun ended it
    assert story["fates"]["a", 0]["fate"] in ("collective_failure", "terminated_by_agent"), story["fates"]


@pytest.mark.root
@requires("prometheus", "slurm")
def test_story_of_a_slurm_step_on_two_nodes_names_node_b_first(tmp_path: Path) -> None:
    """A real step of two nodes (``srun --nodes=2 --mem=1536M``: a slurmstepd and a step
    memory cgroup on each) is one job, ``JOBID.STEPID``, on both nodes' daemons. Rank 1, on
    node B, grows past its node's step cgroup; Slurm then ends rank 0 (--kill-on-bad-exit)."""
    grow = tmp_path / "grow"
    with SlurmJob(
        tmp_path, "sl-story", nodes=2, hold_mb=50, workers=1,
        grow_rank=1, grow_file=grow, grow_after=0, grow_mb=8, grow_interval=0.05,
    ) as job:  # fmt: skip
        ranks = job.ready()
        story, doc_b = _two_node_story(tmp_path, job, ranks, grow, relayed=False)
    assert re.fullmatch(r"\d+\.0", story["job"]), story["job"]  # Slurm's job and step
    # node B's own Slurm cgroup (the job's --mem, on each node)
    assert f"/slurm_{slurm.NODES[1]}/" in doc_b["killer"]["summary"], doc_b["killer"]
    # rank 0's collective failed first (its peer gone), then Slurm ended the step: its last
    # lines go through its slurmstepd to srun, on whichever node srun runs, never to node A's
    # daemon, so node A's postmortem says only "exit status 1, no exception seen" and the
    # story, honest, cannot tie it to rank 1's death
    assert story["fates"]["a", 0]["fate"] in ("terminated_by_agent", "collective_failure", "unknown"), story
    chain = [e["instance"] for e in story["chain"] if e["event"] == "death"]
    assert chain == [story["first_death"]["instance"], story["fates"]["a", 0]["instance"]], story["chain"]


class TwoNodeMpiJob(MpiJob):
    """One Open MPI job on two "nodes" of this machine: mpirun is given two loopback
    addresses as hosts, starts rank 0 itself and, through a stand-in for ssh
    (tests/workloads/local_rsh.sh), an orted for the second, detached from it and inside
    ``cgroup``, which starts rank 1."""

    def __init__(self, tmp: Path, name: str, cgroup: Path, **workload: Any) -> None:
        super().__init__(tmp, name, env={"TW_RSH_CGROUP": str(cgroup)}, **workload)

    def command(self, nproc: int, args: list[str]) -> list[str]:
        cmd = super().command(nproc, args)
        rsh = REPO / "tests" / "workloads" / "local_rsh.sh"
        return [cmd[0], "--mca", "plm_rsh_agent", str(rsh), "--host", "127.0.0.1:1,127.0.0.2:1", *cmd[1:]]


@dataclass
class Node:
    """What a node's daemon is asked about: the process that starts the job's ranks there."""

    agent_pid: int
    dir: Path


def _two_node_story(
    tmp_path: Path, job: TorchrunJob, ranks: dict[int, list[int]], grow: Path, relayed: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A job of one rank on each of two nodes (rank 0 on A, rank 1 on B, each started by
    its own process there, each node watched by its own daemon through ``--pid``, both
    scraped by a real Prometheus): once both nodes' daemons label it the same job, rank 1
    grows (``grow``) past node B's limit. The story (the CLI) must name rank 1 first with
    node B's postmortem's killer, each rank with its fate. The story, with its fates keyed
    by ("a"|"b", rank), and node B's postmortem."""
    node_a, node_b = Node(parent_pid(ranks[0][0]), job.dir), Node(parent_pid(ranks[1][0]), job.dir)
    assert node_a.agent_pid != node_b.agent_pid
    with (
        DaemonProc(tmp_path / "a", "--pid", str(node_a.agent_pid), interval=0.5) as daemon_a,
        DaemonProc(tmp_path / "b", "--pid", str(node_b.agent_pid), interval=0.5) as daemon_b,
    ):
        inst_a, inst_b = daemon_a.base.removeprefix("http://"), daemon_b.base.removeprefix("http://")
        seen_a = daemon_a.wait_sampled(node_a, {0: ranks[0]})  # type: ignore[arg-type]
        seen_b = daemon_b.wait_sampled(node_b, {1: ranks[1]})  # type: ignore[arg-type]
        job_id = seen_a["job"]
        assert job_id == seen_b["job"] == seen_a["run_id"] == seen_b["run_id"], (seen_a, seen_b)
        with PrometheusServer(tmp_path, inst_a, inst_b) as prom:

            def both_nodes() -> bool:
                q = f'count by (instance) (trainwatch_rank_info{{job="{job_id}"}})'
                got = {s["metric"]["instance"]: s["value"][1] for s in prom.api("query", query=q)["result"]}
                return got == {inst_a: "1", inst_b: "1"}

            wait_for(both_nodes, 60, "prometheus to hold both nodes' ranks of the job", 0.5)
            grow.touch()
            doc_b = job_postmortem(daemon_b, victim_rank=1, want_fates=1, job=node_b)  # type: ignore[arg-type]
            assert doc_b["killer"]["kind"] == "cgroup_oom", doc_b["killer"]
            # the postmortem is rewritten when the kernel's record of the kill is read (a CI
            # trial's story read the rewrite, the test the first version): the story is
            # compared with the settled one
            doc_b = settled_postmortem(
                daemon_b, doc_b, lambda d: any(e["source"] == "kmsg" for e in d["killer"]["evidence"])
            )
            job.proc.wait(120)
            doc_a = job_postmortem(daemon_a, victim_rank=None, want_fates=1, job=node_a)  # type: ignore[arg-type]
            if relayed:  # mpirun relays its ranks' output after they died: the postmortem
                # is rewritten with their last lines (rank 0's collective lost its peer)
                # or mpirun ended rank 0 before its collective failed (a race): its teardown
                settled_postmortem(
                    daemon_a,
                    doc_a,
                    lambda d: (
                        d["killer"].get("peer_failure") is True or d["killer"]["kind"] == "agent_teardown"
                    ),
                )
            want = {inst_a: {"0"}, inst_b: {"1"}}
            wait_for(
                lambda: deaths_in_prometheus(prom, job_id) == want, 60, "prometheus to hold the deaths", 0.5
            )
            rc, out, err = story_cli(prom, job_id)
            assert rc == 0, err
            (tmp_path / "story.json").write_text(out)  # kept with the test's files when it fails
            story = json.loads(out)
    assert story["job"] == job_id
    first = story["first_death"]
    assert (first["instance"], first["rank"], first["pid"]) == (inst_b, 1, ranks[1][0]), story
    assert first["killer"] == doc_b["killer"] and first["postmortem"] == doc_b["id"]
    node = {inst_a: "a", inst_b: "b"}
    fates = {(node[r["instance"]], r["rank"]): r for r in story["ranks"]}
    assert set(fates) == {("a", 0), ("b", 1)}, fates
    assert fates["b", 1]["fate"] == "root_cause" and fates["a", 0]["died"] is not None, fates
    assert not any("could not be read" in g for g in story["gaps"]), story["gaps"]
    return {**story, "fates": fates}, doc_b
