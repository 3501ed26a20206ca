"""The sender catalogue (sidecar/autopsy/senders.py) on sender chains shaped as each tool's
are, and the sender as /proc shows it (sidecar/probes/senders.py) for a real chain. The
real kills by stand-ins are in tests/e2e/test_senders.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.autopsy.senders import TOOLS, tool_of
from sidecar.model.events import Sender
from sidecar.probes.senders import describe_sender
from tests.support.e2e import wait_for


def _sender(
    comm: str, *parents: str, exe: str | None = None, cgroup: str | None = None, pid: int = 500
) -> Sender:
    chain = tuple((400 - i, name, None) for i, name in enumerate(parents))
    return Sender(pid, comm, exe, 0, cgroup, chain)


@pytest.mark.parametrize(
    ("sender", "victim_cgroup", "tool"),
    [
        (_sender("slurmstepd", "systemd"), None, "slurm"),
        (_sender("kill", "python3", cgroup="/slurm/uid_1000/job_42/step_0"), None, "slurm"),
        (
            _sender("kill", "python3", cgroup="/system.slice/slurmstepd.scope/job_42/step_batch"),
            None,
            "slurm",
        ),
        (_sender("kubelet", "systemd"), None, "kubelet"),
        (_sender("runc", "containerd-shim", "systemd"), "/kubepods/burstable/pod1/c1", "kubelet"),
        (_sender("containerd-shim", "systemd"), "/system.slice/docker-abc.scope", "containerd"),
        (_sender("dockerd", "systemd"), None, "docker"),
        (_sender("systemd-oomd", "systemd"), None, "systemd-oomd"),
        (_sender("earlyoom", "systemd"), None, "earlyoom"),
        (_sender("systemd", pid=1), None, "systemd"),
        (_sender("ft_launcher", "bash", "sshd"), None, "nvrx"),
        (_sender("raylet", "gcs_server"), None, "ray"),
        (_sender("ray::IDLE", "raylet"), None, "ray"),
        (_sender("kill", "bash", "sshd", "systemd"), None, "user"),
        (_sender("bash", "tmux: server", "systemd"), None, "user"),
        # a person's shell inside a Slurm allocation or a container is still a person's kill
        (_sender("kill", "bash", "slurmstepd", cgroup="/slurm/uid_0/job_1/step_0"), None, "user"),
        (_sender("kill", "sh", "containerd-shim"), "/kubepods/pod1/c1", "user"),
        (_sender("python3", "python3"), None, "unknown"),
        # gone before /proc was read: a command made to send signals is a person's or a script's
        (_sender("kill"), None, "user"),
        (_sender("pkill", "cron"), None, "user"),
        (_sender("timeout", "python3"), None, "user"),
        (_sender("python3"), None, "unknown"),  # gone, and nothing to go by
    ],
)
def test_each_tool_is_known_by_its_chain(sender: Sender, victim_cgroup: str | None, tool: str) -> None:
    assert tool in TOOLS
    assert tool_of(sender, agent_pid=77, victim_cgroup=victim_cgroup) == tool


def test_the_agent_or_what_it_started_is_torchelastic() -> None:
    assert tool_of(_sender("python3", pid=77), agent_pid=77) == "torchelastic"
    timer = Sender(501, "python3", None, 0, None, ((77, "pt_elastic", None), (1, "systemd", None)))
    assert tool_of(timer, agent_pid=77) == "torchelastic"


def test_an_executable_s_name_counts_as_much_as_its_comm() -> None:
    """A process renamed (prctl) keeps its executable: /usr/sbin/slurmstepd is Slurm's."""
    assert tool_of(_sender("worker", exe="/usr/sbin/slurmstepd"), None) == "slurm"
    assert tool_of(_sender("x", exe="/usr/bin/earlyoom (deleted)"), None) == "earlyoom"


def test_a_real_sender_is_described_with_its_parents() -> None:
    """This process starts a shell that starts a sleeper: the sleeper's chain is the shell,
    then this process, each with its exe; its uid and cgroup are read."""
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    try:
        assert shell.stdout is not None
        sleeper = int(shell.stdout.readline())
        comm = Path(f"/proc/{sleeper}/comm")
        wait_for(lambda: comm.read_text().strip() == "sleep", 10, "the shell's child to exec sleep", 0.01)
        s = describe_sender("/proc", sleeper, "sleep")
        # the sleep the shell found: a multi-call binary's where sleep is a link (busybox, uutils)
        assert s.comm == "sleep" and s.exe == os.path.realpath(shutil.which("sleep") or "sleep")
        assert s.uid == os.getuid() and s.cgroup is not None
        assert [p for p, _, _ in s.parents[:2]] == [shell.pid, os.getpid()]
        assert s.parents[0][1] == "sh" and s.parents[1][2] == os.path.realpath(sys.executable)
        assert tool_of(s, agent_pid=None) == "user"
        gone = describe_sender("/proc", 2**22 + 7, "kill")  # no such process: what the tracepoint said
        assert (gone.pid, gone.comm, gone.parents) == (2**22 + 7, "kill", ())
    finally:
        shell.kill()
        shell.wait()
        if shell.stdout is not None:
            shell.stdout.close()


def test_the_advice_follows_the_tool() -> None:
    from sidecar.autopsy.advice import advice
    from sidecar.autopsy.evidence import Facts, RankState, Verdict
    from sidecar.model import Confidence, Kind

    def tips(tool: str) -> list[str]:
        facts = Facts(sender=Sender(9, "x", None, 1000, None, (), tool))
        v = Verdict(
            RankState("1", 1, 1, 5), Kind.EXTERNAL_SIGNAL, Confidence.CERTAIN, "s", (), {}, None, facts
        )
        return advice(v, [])

    assert tips("slurm")[0].startswith("Slurm ended the step: `sacct")
    assert tips("user")[0].startswith("It was killed from a shell on this node (uid 1000)")
    assert tips("unknown")[0].startswith("Nothing on this machine recorded an OOM")


SLURM_TIMES = (1_800_000_000, 1_800_000_000 + 4 * 3600)  # an allocation of --time=04:00:00


@pytest.mark.parametrize(
    ("seen_at", "chain", "detail", "said"),
    [
        # at the limit (the controller's check comes a little after the end): the time limit
        (
            SLURM_TIMES[1] + 31,
            ("slurmstepd",),
            "time_limit",
            "ended the job at its time limit (--time=04:00:00)",
        ),
        (SLURM_TIMES[1] - 2, ("slurmstepd",), "time_limit", "(--time=04:00:00)"),
        # well before it: a cancellation, a preemption, a node failure
        (SLURM_TIMES[0] + 600, ("slurmstepd",), "cancelled", "03:50:00 before the job's time limit"),
        # scancel in the chain says so, whenever it came
        (
            SLURM_TIMES[1] + 31,
            ("scancel", "bash"),
            "cancelled",
            "Slurm's scancel (uid 0): the job was cancelled",
        ),
        # no allocation times in the rank's environment: the tool, without the why
        (None, ("slurmstepd",), None, "Slurm (the job step was cancelled or reached its time limit)"),
    ],
)
def test_slurm_says_whether_the_time_limit_ended_the_job(seen_at, chain, detail, said) -> None:
    from sidecar.autopsy.senders import slurm_detail

    sender = Sender(500, chain[0], None, 0, None, tuple((400, c, None) for c in chain[1:]), seen_at=seen_at)
    assert tool_of(sender, None) == "slurm"
    got = slurm_detail(sender, SLURM_TIMES if seen_at is not None else None)
    assert got[0] == detail and said in got[1], got
