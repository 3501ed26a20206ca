"""Who sent the kill, for real: a rank of a real torchrun job is SIGKILLed by a process that
stands in for a tool (a script under the tool's name, in a cgroup shaped like that tool's
where the tool has one) or by a real shell. The postmortem's ``killer.sender`` carries the
sender, its parents and the tool, and the summary says it in words."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sidecar.front.demo import join_cgroup, memory_hierarchy
from tests.support.e2e import DaemonProc, TorchrunJob, job_postmortem
from tests.support.skips import requires

STAND_IN = """#!{python}
import os, signal, sys, time
os.kill(int(sys.argv[1]), signal.SIGKILL)
time.sleep(3)  # a tool outlives its kill (slurmstepd, a shim): /proc still shows it
"""


@contextlib.contextmanager
def _cgroup(rel: str):
    """A memory cgroup at ``rel`` under the hierarchy's root (made, then removed)."""
    found = memory_hierarchy()
    assert found is not None
    _version, root = found
    path = root / rel
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        for level in [Path(rel), *Path(rel).parents][:-1]:  # the leaf first, up to the root's child
            with contextlib.suppress(OSError):
                (root / level).rmdir()


def _stand_in(tmp: Path, name: str) -> Path:
    exe = tmp / "bin" / name
    exe.parent.mkdir(exist_ok=True)
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(0o755)
    return exe


NOW = int(time.time())
# the allocation of a Slurm job as its ranks' environment tells it (--time=01:00:00)
ENDED = {"SLURM_JOB_START_TIME": str(NOW - 3600 - 60), "SLURM_JOB_END_TIME": str(NOW - 60)}
RUNNING = {"SLURM_JOB_START_TIME": str(NOW - 600), "SLURM_JOB_END_TIME": str(NOW - 600 + 4 * 3600)}


@pytest.mark.root
@requires("tracefs", "memcg")
@pytest.mark.parametrize(
    ("tool", "name", "cgroup", "words", "env"),
    [
        ("slurm", "slurmstepd", "slurm_{id}/uid_0/job_1/step_0", "by Slurm (the job step was", None),
        (
            "slurm",
            "slurmstepd",
            "slurm_{id}/uid_0/job_1/step_0",
            "by Slurm, which ended the job at its time limit (--time=01:00:00)",
            ENDED,
        ),
        (
            "slurm",
            "slurmstepd",
            "slurm_{id}/uid_0/job_1/step_0",
            "before the job's time limit (--time=04:00:00)",
            RUNNING,
        ),
        ("kubelet", "kubelet", "system.slice_{id}/kubelet.service", "by Kubernetes' kubelet", None),
        ("containerd", "containerd-shim", None, "by the container runtime", None),
        ("docker", "dockerd", "system.slice_{id}/docker.service", "by Docker", None),
        (
            "systemd",
            "systemd",
            "system.slice_{id}/trainer.service",
            "by systemd (its unit was stopped)",
            None,
        ),
        ("nvrx", "ft_launcher", None, "by NVIDIA Resiliency Extension", None),
        ("ray", "raylet", None, "by Ray", None),
        ("user", None, None, "by a shell on this node", None),
    ],
)
def test_the_sender_s_tool_is_named(tmp_path, tool, name, cgroup, words, env):
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(tmp_path, f"send-{tool}", hold_mb=50, workers=0, env=env) as job,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        victim = pids[1][0]
        with contextlib.ExitStack() as stack:
            if name is None:  # a real shell's own kill builtin
                cmd = ["bash", "-c", f"kill -9 {victim}; sleep 3"]
            else:
                cmd = [str(_stand_in(tmp_path, name)), str(victim)]
            if cgroup is not None:
                where = stack.enter_context(_cgroup(cgroup.format(id=uuid.uuid4().hex[:8])))
                cmd = [*join_cgroup(where), *cmd]
            sender = subprocess.Popen(cmd)
            stack.callback(sender.wait)
            doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
    k = doc["killer"]
    assert (k["kind"], k["confidence"]) == ("external_signal", "certain"), k
    s = k["sender"]
    assert s["tool"] == tool, s
    assert s["pid"] == sender.pid and s["uid"] == os.getuid(), s
    assert s["comm"] == (name or "bash")
    assert s["parents"] and s["parents"][0]["pid"] == os.getpid(), s  # started by this test
    if cgroup is not None:
        assert s["cgroup"].endswith(cgroup.rsplit("}", 1)[-1]), s
    assert s["detail"] == {id(ENDED): "time_limit", id(RUNNING): "cancelled"}.get(id(env)), s
    assert words in k["summary"] and f"pid {sender.pid} ({s['comm']})" in k["summary"], k["summary"]
    print(
        f"\n| {tool} | {s['comm']} | {s['cgroup']} | {s['detail']} | {k['summary']} |"
    )  # pytest -s: the table
