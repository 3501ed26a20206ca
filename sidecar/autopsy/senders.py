"""Who sent the kill, as a tool: a catalogue of mechanisms, each stated as what it looks
like from the sender's side (its own name or executable, its parents', its cgroup), never
as a case. The sender of a signal is the process that called kill(2); the tool is the
nearest thing in its chain that the catalogue knows:

- ``torchelastic``: the torchrun agent itself, or a process the agent started (its timer).
- ``slurm``: slurmstepd/slurmd/scancel/srun in the chain, or the sender in a Slurm cgroup
  (``/slurm/uid_N/job_N/step_N``, ``/system.slice/slurmstepd.scope/job_N``).
- ``kubelet``: kubelet in the chain (an eviction, a pod's deletion).
- ``containerd`` / ``docker``: the container runtime (containerd-shim, runc, crun; dockerd,
  docker-init) stopping a container, with no kubelet above it.
- ``systemd-oomd``, ``earlyoom``, ``oomd``: the userspace OOM daemons.
- ``systemd``: systemd (pid 1 or a user manager) stopping a unit.
- ``nvrx``: NVIDIA Resiliency Extension's launcher or rank monitor (``ft_launcher``).
- ``ray``: Ray's raylet or a Ray worker (``ray::`` processes).
- ``user``: a shell (an interactive or scripted kill) with none of the above above it; else a
  command made to send signals (kill, pkill, killall, timeout) in the chain, even when it
  exited before /proc could show its parents.
- ``unknown``: nothing known in the chain (or the sender was gone before /proc was read).
"""

from __future__ import annotations

import os
import re

from sidecar.model.events import Sender

__all__ = ["TOOLS", "slurm_detail", "tool_of", "words"]

SLURM = ("slurmstepd", "slurmd", "scancel", "srun", "salloc", "sbatch", "sattach")
CONTAINERD = ("containerd", "containerd-shim", "runc", "crun", "conmon", "podman")
DOCKER = ("dockerd", "docker", "docker-init", "docker-proxy")
SHELLS = ("bash", "sh", "dash", "zsh", "fish", "ksh", "tcsh", "csh", "busybox")
# commands whose job is to send a signal, run by a person or a script: a sender that is one
# of them is a user's even when it exited before /proc could show its parents
KILL_COMMANDS = ("kill", "pkill", "killall", "skill", "timeout")
SLURM_CGROUP = re.compile(r"/slurm[^/]*/.*job_?\d+|/job_\d+/step_|slurmstepd")
TOOLS = (
    "torchelastic", "slurm", "kubelet", "containerd", "docker", "systemd-oomd", "earlyoom", "oomd",
    "systemd", "nvrx", "ray", "user", "unknown",
)  # fmt: skip


def _names(comm: str, exe: str | None) -> set[str]:
    names = {comm}
    if exe:
        names.add(os.path.basename(exe.removesuffix(" (deleted)")))
    return names


def _tool_of_one(names: set[str], pid: int) -> str | None:
    """The tool one process of the chain is, by its own names (None: not one we know)."""
    if names & set(SLURM):
        return "slurm"
    if "kubelet" in names:
        return "kubelet"
    if any(n.startswith("containerd-shim") for n in names) or names & set(CONTAINERD):
        return "containerd"
    if names & set(DOCKER):
        return "docker"
    if "systemd-oomd" in names:
        return "systemd-oomd"
    if "earlyoom" in names:
        return "earlyoom"
    if "oomd" in names:
        return "oomd"
    if "ft_launcher" in names:
        return "nvrx"
    if "raylet" in names or "gcs_server" in names or any(n.startswith("ray::") for n in names):
        return "ray"
    if pid == 1 or "systemd" in names:
        return "systemd"
    return None


def tool_of(sender: Sender, agent_pid: int | None, victim_cgroup: str | None = None) -> str:
    """The tool behind ``sender``: the nearest process of its chain (the sender, then its
    parents) that the catalogue knows. A shell nearer than any of them makes it a user's (a
    person's or a script's kill, wherever that shell runs: a Slurm allocation, a container).
    The container runtime stopping a container of a Kubernetes pod is the kubelet's doing."""
    if agent_pid is not None and (
        sender.pid == agent_pid or any(p == agent_pid for p, _, _ in sender.parents)
    ):
        return "torchelastic"
    chain = [(sender.pid, _names(sender.comm, sender.exe))]
    chain += [(pid, _names(comm, exe)) for pid, comm, exe in sender.parents]
    for pid, names in chain:
        tool = _tool_of_one(names, pid)
        if tool in ("containerd", "docker") and victim_cgroup and "kubepods" in victim_cgroup:
            return "kubelet"
        if tool is not None:
            return tool
        if names & set(SHELLS):
            return "user"
    if sender.cgroup and SLURM_CGROUP.search(sender.cgroup):
        return "slurm"
    if any(names & set(KILL_COMMANDS) for _, names in chain):
        return "user"
    return "unknown"


# slurmctld enforces a time limit from its periodic check, so the kill comes at or after the
# allocation's end (SLURM_JOB_END_TIME); a few seconds of clock difference between the
# controller and this node are allowed
SLURM_END_SLACK_S = 5.0


def _hms(seconds: float) -> str:
    s = round(seconds)
    days, s = divmod(s, 86400)
    return (f"{days}-" if days else "") + f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def slurm_detail(sender: Sender, times: tuple[int, int] | None) -> tuple[str | None, str]:
    """For a Slurm kill: ("time_limit" | "cancelled" | None, the words). The job's time limit
    is known from the rank's SLURM_JOB_START_TIME and SLURM_JOB_END_TIME; a kill from scancel
    is one in the sender's chain."""
    chain = [_names(sender.comm, sender.exe), *(_names(c, e) for _, c, e in sender.parents)]
    if any("scancel" in names for names in chain):
        return "cancelled", f"Slurm's scancel (uid {sender.uid}): the job was cancelled"
    if times is None or sender.seen_at is None:
        return None, words("slurm")
    start, end = times
    limit = f"--time={_hms(end - start)}"
    if sender.seen_at >= end - SLURM_END_SLACK_S:
        return "time_limit", f"Slurm, which ended the job at its time limit ({limit})"
    return "cancelled", (
        f"Slurm, {_hms(end - sender.seen_at)} before the job's time limit ({limit}): the job was cancelled "
        "(scancel), preempted, or its node failed"
    )


def words(tool: str) -> str:
    """The tool, as a summary says it."""
    return {
        "torchelastic": "the torchrun agent",
        "slurm": "Slurm (the job step was cancelled or reached its time limit)",
        "kubelet": "Kubernetes' kubelet (the pod was evicted or deleted)",
        "containerd": "the container runtime (the container was stopped)",
        "docker": "Docker (the container was stopped)",
        "systemd-oomd": "systemd-oomd",
        "earlyoom": "earlyoom",
        "oomd": "oomd",
        "systemd": "systemd (its unit was stopped)",
        "nvrx": "NVIDIA Resiliency Extension's launcher or rank monitor",
        "ray": "Ray",
        "user": "a shell on this node (a person or a script)",
    }.get(tool, "")
