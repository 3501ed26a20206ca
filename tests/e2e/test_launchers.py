"""Real jobs under launchers other than torchrun, watched by the real daemon, and real deaths:
a rank SIGKILLed from outside, a rank at its memory cgroup's limit. Each asserts the victim,
the killer and every other rank's fate as that launcher's teardown makes it.

- DeepSpeed's launcher (``deepspeed --num_gpus 2 script``, CPU): the runner starts the
  per-node launcher ``python -u -m deepspeed.launcher.launch``, which starts each rank with
  RANK and LOCAL_RANK in its environment, and SIGTERMs every other rank's tree when one
  exits non-zero (``deepspeed/launcher/launch.py``). Under ``trainwatch run`` too, where
  the launcher is below the command.
- ``torch.multiprocessing.spawn`` (tests/workloads/spawned.py, as PyTorch's DDP tutorial
  launches): the script that calls spawn is the launcher; each spawned child sets its rank in
  its own ``os.environ``, so it is found by the process group it joins and numbered by its
  order. When one exits non-zero, spawn's ``join`` SIGTERMs the others.
- Lightning's own launcher (tests/workloads/lightning_job.py, Fabric "ddp" on CPU): the script
  is rank 0 and re-runs itself with LOCAL_RANK=1; its observer thread SIGKILLs the others and
  rank 0 itself when a child exits non-zero (within 5 s).
- Hugging Face ``accelerate launch --multi_gpu``: torch's elastic agent in accelerate's own
  process (named ``pt_elastic``): a torchrun job.
- Open MPI's ``mpirun -np 2`` (tests/workloads/task_job.py): the ranks are mpirun's children,
  numbered by OMPI_COMM_WORLD_RANK; when one dies, mpirun aborts the job and signals the rest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup
from tests.support.e2e import (
    DEEPSPEED,
    REPO,
    WORKLOAD,
    AccelerateJob,
    DaemonProc,
    DeepSpeedJob,
    LightningJob,
    MpichJob,
    MpiJob,
    SpawnJob,
    descendants,
    free_port,
    job_postmortem,
    settled_postmortem,
    survivor_fate_right,
)
from tests.support.skips import requires

GIB = 1 << 30


@requires("deepspeed")
def test_a_deepspeed_rank_killed_from_outside_is_named_and_the_launcher_s_teardown_is_told(tmp_path):
    """The ranks are found below DeepSpeed's launcher, numbered by their RANK, their forked
    workers in their trees and never ranks; rank 1 is then SIGKILLed from outside."""
    with (
        DaemonProc(tmp_path) as daemon,
        DeepSpeedJob(tmp_path, "ds-kill", hold_mb=50, workers=1) as job,
    ):
        pids = job.ready()
        seen = daemon.wait_sampled(job, pids)
        assert seen["launcher"] == "deepspeed" and seen["job"] == str(job.agent_pid), seen
        ranks = {r["rank"]: r for r in seen["ranks"]}
        assert sorted(ranks) == [0, 1]  # the workers (one each) are no ranks
        for rank, rank_pids in pids.items():
            assert ranks[rank]["pid"] == rank_pids[0] and ranks[rank]["rank_source"] == "RANK", ranks[rank]
            assert ranks[rank]["tree_processes"] == len(rank_pids), ranks[rank]
        m = daemon.metrics()
        info = {
            labels["rank"]: labels for labels, _ in m["trainwatch_rank_info"] if labels["job"] == seen["job"]
        }
        assert {r: labels["launcher"] for r, labels in info.items()} == {"0": "deepspeed", "1": "deepspeed"}
        os.kill(pids[1][0], signal.SIGKILL)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
    killer = doc["killer"]
    assert killer["kind"] == "external_signal", killer
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0]), doc["ranks"]
    assert doc["job"]["launcher"] == "deepspeed" and {r["launcher"] for r in doc["ranks"]} == {"deepspeed"}
    assert {r["rank_source"] for r in doc["ranks"]} == {"RANK"}


@requires("deepspeed")
def test_trainwatch_run_names_the_death_of_a_job_deepspeed_launched(tmp_path):
    """`trainwatch run -- deepspeed ...`: the launcher is below the command (the runner starts
    it), and the job's postmortem is still this run's: named on stderr after the job's own
    output, the run failing as the runner does."""
    cmd = [
        sys.executable, "-m", "sidecar", "run", "--postmortem-dir", str(tmp_path / "pm"), "--interval", "0.5",
        "--", DEEPSPEED, "--num_gpus=2", "--no_local_rank",
        f"--master_port={free_port()}", str(WORKLOAD), "--hold-mb=30", "--workers=0", "--duration=120",
        "--raise-rank=1", "--raise-after=1",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert out.returncode != 0, out.stderr[-3000:]
    assert "a bad batch on purpose" in out.stderr  # the rank's own words passed through
    lines = out.stderr.rstrip().splitlines()
    assert lines[-1].startswith("trainwatch: postmortem: trainwatch postmortem "), lines[-5:]
    assert re.match(r"trainwatch: rank 1 \(pid \d+\): python_exception \(certain\)", lines[-2]), lines[-5:]
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "pm").glob("*.json")]
    assert doc["job"]["launcher"] == "deepspeed" and doc["victim"]["rank"] == 1
    assert "ValueError: rank 1: a bad batch on purpose" in doc["killer"]["summary"], doc["killer"]


def test_an_mp_spawn_rank_killed_from_outside_is_named_and_the_parent_s_teardown_is_told(tmp_path):
    """Spawned ranks are found by the group they join, numbered by their order; their own
    spawn-context workers (fresh interpreters, as a DataLoader with the spawn context starts)
    are in their trees, never ranks. Rank 1 is then SIGKILLed from outside."""
    with (
        DaemonProc(tmp_path) as daemon,
        SpawnJob(tmp_path, "spawn-kill", hold_mb=50, workers=2, worker_mb=8, worker_context="spawn") as job,
    ):
        pids = job.ready()
        seen = daemon.wait_sampled(job, pids)
        assert seen["launcher"] == "spawn" and seen["job"] == str(job.agent_pid), seen
        ranks = {r["local_rank"]: r for r in seen["ranks"]}
        assert sorted(ranks) == [0, 1], seen["ranks"]  # four workers, no rank among them
        for rank, rank_pids in pids.items():
            row = ranks[rank]
            assert row["pid"] == rank_pids[0] and row["rank_source"] == "order" and row["rank"] is None, row
            assert row["tree_processes"] == len(rank_pids) == 3, row
        info = [
            labels for labels, _ in daemon.metrics()["trainwatch_rank_info"] if labels["job"] == seen["job"]
        ]
        assert sorted((i["rank"], i["launcher"]) for i in info) == [("local0", "spawn"), ("local1", "spawn")]
        os.kill(pids[1][0], signal.SIGKILL)
        doc = job_postmortem(daemon, victim_rank=None, want_fates=2, job=job)
        assert job.proc.wait(60) != 0  # spawn's join raised ProcessExitedException
    killer = doc["killer"]
    assert killer["kind"] == "external_signal", killer
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    rows = {r["pid"]: r for r in doc["ranks"]}
    assert rows[pids[1][0]]["fate"] == "root_cause" and survivor_fate_right(rows[pids[0][0]]), doc["ranks"]
    assert doc["job"]["launcher"] == "spawn" and {r["rank_source"] for r in doc["ranks"]} == {"order"}


@requires("lightning")
def test_a_lightning_rank_killed_from_outside_is_named_and_rank_0_s_teardown_is_told(tmp_path):
    """Rank 0 is the script, the job's launching process; rank 1 its re-run. Rank 0's
    spawn-context workers inherit its LOCAL_RANK=0 and are never ranks. Rank 1 is then
    SIGKILLed from outside; Lightning's observer in rank 0 SIGKILLs rank 0."""
    with (
        DaemonProc(tmp_path) as daemon,
        LightningJob(tmp_path, "lt-kill", hold_mb=50, workers=1, worker_mb=8, worker_context="spawn") as job,
    ):
        pids = job.ready()
        seen = daemon.wait_sampled(job, pids)
        assert seen["launcher"] == "lightning" and seen["job"] == str(job.agent_pid), seen
        ranks = {r["local_rank"]: r for r in seen["ranks"]}
        assert sorted(ranks) == [0, 1], seen["ranks"]
        assert ranks[0]["pid"] == job.agent_pid == pids[0][0] and ranks[0]["rank_source"] == "order"
        assert ranks[1]["pid"] == pids[1][0] and ranks[1]["rank_source"] == "LOCAL_RANK", ranks[1]
        # each tree: the rank, its worker and the spawn context's resource tracker; never the
        # other rank (rank 1 and its tree are below rank 0)
        rank1_tree = {pids[1][0], *descendants(pids[1][0])}
        expected = {0: {pids[0][0], *descendants(pids[0][0])} - rank1_tree, 1: rank1_tree}
        for rank, rank_pids in pids.items():
            assert set(rank_pids) <= expected[rank], (rank_pids, expected[rank])
            assert ranks[rank]["tree_processes"] == len(expected[rank]), (ranks[rank], expected[rank])
        os.kill(pids[1][0], signal.SIGKILL)
        doc = job_postmortem(daemon, victim_rank=None, want_fates=2, job=job)
        job.proc.wait(60)
    assert doc["killer"]["kind"] == "external_signal", doc["killer"]
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    rows = {r["pid"]: r for r in doc["ranks"]}
    assert rows[pids[1][0]]["fate"] == "root_cause" and survivor_fate_right(rows[pids[0][0]]), json.dumps(
        doc, indent=1
    )
    assert doc["job"]["launcher"] == "lightning"


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(MpiJob, marks=requires("openmpi"), id="openmpi"),
        pytest.param(MpichJob, marks=requires("mpich"), id="mpich"),
    ],
)
def test_an_mpi_rank_killed_from_outside_is_named_and_the_abort_is_told(tmp_path, make):
    """The ranks are found below the process that starts them on the node (Open MPI's
    mpirun, MPICH's hydra_pmi_proxy) by their MPI rank, an Open MPI job keyed by its job id;
    rank 1 is then SIGKILLed from outside and the launcher aborts the job."""
    with DaemonProc(tmp_path) as daemon, make(tmp_path, "mpi-kill", hold_mb=50, workers=1) as job:
        pids = job.ready()
        seen = daemon.wait_sampled(job, pids)
        assert seen["launcher"] == "mpi", seen
        if make is MpiJob:
            assert seen["job"] == seen["run_id"] and seen["run_id"].isdigit(), seen
        else:  # MPICH gives its ranks no job id: the job is its node's proxy
            assert seen["run_id"] is None and seen["job"] == str(seen["agent_pid"]), seen
            assert _comm(seen["agent_pid"]) == "hydra_pmi_proxy", seen
        ranks = {r["rank"]: r for r in seen["ranks"]}
        assert sorted(ranks) == [0, 1]
        var = "OMPI_COMM_WORLD_RANK" if make is MpiJob else "PMI_RANK"
        for rank, rank_pids in pids.items():
            assert ranks[rank]["pid"] == rank_pids[0] and ranks[rank]["rank_source"] == var
            assert ranks[rank]["tree_processes"] == len(rank_pids), ranks[rank]
        os.kill(pids[1][0], signal.SIGKILL)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        assert job.proc.wait(60) != 0
        doc = settled_postmortem(daemon, doc, lambda d: survivor_fate_right(d["ranks"][0]))
    assert doc["killer"]["kind"] == "external_signal", doc["killer"]
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0]), json.dumps(doc, indent=1)
    assert doc["job"]["launcher"] == "mpi"


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


@pytest.mark.root
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(DeepSpeedJob, marks=requires("deepspeed", "memcg", "kmsg"), id="deepspeed"),
        pytest.param(SpawnJob, marks=requires("memcg", "kmsg"), id="spawn"),
        pytest.param(LightningJob, marks=requires("lightning", "memcg", "kmsg"), id="lightning"),
        pytest.param(MpiJob, marks=requires("openmpi", "memcg", "kmsg"), id="mpi"),
        pytest.param(MpichJob, marks=requires("mpich", "memcg", "kmsg"), id="mpich"),
    ],
)
def test_a_rank_at_its_cgroup_limit_is_named_with_certainty_whoever_launched_it(tmp_path, make):
    """The whole launch in a 1.5 GiB memory cgroup; rank 1 grows until the kernel kills it.
    The other rank's fate as its launcher's teardown makes it (read once the launcher has
    exited: mpirun relays its ranks' last lines after they died)."""
    with memory_cgroup(int(1.5 * GIB), f"trainwatch-{make.__name__}-oom") as (_version, parent, child):
        wrap = join_cgroup(child)  # the launcher, and so every rank
        with (
            DaemonProc(tmp_path) as daemon,
            make(
                tmp_path,
                "oom",
                wrap=wrap,
                hold_mb=50,
                workers=0,
                grow_rank=1,
                grow_after=2,
                grow_interval=0.1,
            ) as job,
        ):
            pids = job.ready()
            doc = job_postmortem(daemon, victim_rank=None, want_fates=2, job=job)
            job.proc.wait(60)
            survivor = pids[0][0]
            doc = settled_postmortem(
                daemon,
                doc,
                lambda d: survivor_fate_right(next(r for r in d["ranks"] if r["pid"] == survivor)),
            )
    killer = doc["killer"]
    assert killer["kind"] == "cgroup_oom" and killer["confidence"] == "certain", killer
    assert f"/{parent.name}" in killer["summary"], killer
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    assert {r["pid"]: r["fate"] for r in doc["ranks"]}[pids[1][0]] == "root_cause", doc["ranks"]
    assert doc["job"]["launcher"] == job.LAUNCHER


@requires("accelerate")
def test_an_accelerate_launch_is_torchrun_s_job_and_its_death_is_named(tmp_path):
    """accelerate runs the elastic agent in its own process: found by the name the agent
    gives itself, its ranks by RANK; rank 1 SIGKILLed from outside."""
    with DaemonProc(tmp_path) as daemon, AccelerateJob(tmp_path, "acc-kill", hold_mb=50, workers=1) as job:
        pids = job.ready()
        seen = daemon.wait_sampled(job, pids)
        assert seen["launcher"] == "torchrun" and {r["rank"] for r in seen["ranks"]} == {0, 1}, seen
        os.kill(pids[1][0], signal.SIGKILL)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
    assert doc["killer"]["kind"] == "external_signal" and doc["killer"]["confidence"] == "certain", doc[
        "killer"
    ]
    assert doc["victim"]["pid"] == pids[1][0], doc["victim"]
    assert survivor_fate_right({r["rank"]: r for r in doc["ranks"]}[0]), doc["ranks"]
