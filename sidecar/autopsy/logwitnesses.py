"""What the rules for logs weigh (``autopsy/logs.py``): a scheduler's or a memory daemon's
record of a memory kill, an exception that only relays another process's death, a kernel
OOM record that does not name the rank, the catalog's words in the job's lines, the death's
time and whether a record is near it; and the verdict a rule makes of them."""

from __future__ import annotations

from pathlib import PurePosixPath

from sidecar.autopsy.evidence import EvidenceItem, KernelOom, Verdict
from sidecar.autopsy.logrecords import KernelRecords, LogRecords
from sidecar.autopsy.ranking import told_of
from sidecar.catalog import Hit
from sidecar.model import Confidence, Fate, Kind

__all__ = [
    "MEMORY_RECORDS",
    "SOURCES",
    "catalog_says",
    "death_time",
    "far",
    "near",
    "relayed_death",
    "untied_oom",
    "verdict_with",
]


# a scheduler's or a memory daemon's record of a memory kill in the job, and its killer
MEMORY_RECORDS = {
    "oom_cgroup": Kind.CGROUP_OOM,
    "memory_policy": Kind.USERSPACE_OOM,
    "eviction": Kind.USERSPACE_OOM,
    "memory_monitor": Kind.USERSPACE_OOM,
}
SOURCES = {"slurm": "Slurm", "kubernetes": "Kubernetes", "docker": "Docker"}  # a record's source, named


def relayed_death(v: Verdict, g: LogRecords) -> str | None:
    """The line that relays another process's abrupt death (a Ray actor or worker, a
    DataLoader worker: the catalog's ``relays_death``), in the victim's output, output that
    names no rank, or a launcher's lines, where the victim ended on an exception: the
    exception is that report, not a cause of its own."""
    if v.kind != Kind.PYTHON_EXCEPTION:
        return None
    label = v.victim.label
    for lab, f in g.findings:
        if lab not in (None, label):
            continue
        if f.kind == "said" and f.get("relays_death") == "1":
            return f.line
        # torch's own words for a DataLoader worker's death: by SIGKILL ("Killed", strsignal's
        # word) or with no status at all ("exited unexpectedly")
        if f.kind == "dataloader_killed" and f.get("signal") in (None, "Killed"):
            return f.line
    return g.relayed[0] if g.relayed else None


def untied_oom(v: Verdict, g: LogRecords, k: KernelRecords) -> tuple[KernelOom, str] | None:
    """The kernel's OOM kill a SIGKILLed victim's logs give no pid to tie to it, and why it
    is the victim's all the same: the only one, where the launcher gave no pid (DeepSpeed,
    accelerate); or the only one of the command's name, where the shell's pid is its number
    in a container's pid namespace and the kernel's is the host's."""
    if not v.victim.pid:
        if len(k.ooms) == 1:
            return k.ooms[0], "; the launcher's log gives no pid to tie that kill to the rank."
        return None
    namesake = _namesake(v, g, k)
    if namesake is None:
        return None
    return namesake, (
        f": the only OOM kill of a process of that name; pid {v.victim.pid} is its number in another "
        "pid namespace (a container's), the kernel's is the host's."
    )


def _namesake(v: Verdict, g: LogRecords, k: KernelRecords) -> KernelOom | None:
    """The one kernel OOM kill whose process has the name of the command the logs say the
    victim's pid ran (a shell's ``943 Killed  /usr/bin/python3 train.py``), when no OOM
    kill names that pid: the kernel's comm is the first 15 characters of the name the
    program was run by. None when several kills have that name, or none does."""
    pid = str(v.victim.pid)
    commands = {
        hit.get("command") or ""
        for hit, _ in (*g.exits, *g.said)
        if hit.get("pid") == pid and hit.get("command")
    }
    names = {PurePosixPath(c.split()[0]).name[:15] for c in commands if c.split()}
    if len(names) != 1 or any(o.pid == v.victim.pid for o in k.ooms):
        return None
    same = [o for o in k.ooms if o.comm == next(iter(names))]
    return same[0] if len(same) == 1 else None


def catalog_says(
    v: Verdict, g: LogRecords, k: KernelRecords, death: float | None
) -> tuple[Hit, Confidence] | None:
    """The message of a launcher, the kernel, a shell or a scheduler that decides how the
    victim died (``said.told_of``), among those not far in time from the death. A kernel
    record that names no process (an OOM report's call trace) belongs to one of the kills
    the log names, and none of them is this rank's."""
    near = [
        hit
        for hit, at in g.said
        if not far(at, death) and not (hit.message.channel == "kernel" and hit.get("pid") is None and k.ooms)
    ]
    return told_of(near, v.victim.pid, v.victim.signal, v.victim.status)


def death_time(v: Verdict, g: LogRecords) -> float | None:
    """The victim's death on the wall clock, where a line gave it."""
    return g.death_at.get(v.victim.label)


def near(at: float | None, death: float | None, window: float = 120.0) -> bool:
    """A record ties to the death only when both have a wall-clock time and they are close:
    a kernel log or a journal can hold a day of other kills."""
    return at is not None and death is not None and abs(at - death) <= window


def far(at: float | None, death: float | None, window: float = 120.0) -> bool:
    return at is not None and death is not None and abs(at - death) > window


def verdict_with(
    v: Verdict,
    kind: Kind,
    confidence: Confidence,
    summary: str,
    items: list[EvidenceItem],
    all_torn_down: bool = False,
) -> Verdict:
    fates = dict(v.fates)
    if all_torn_down:
        fates = {label: Fate.TERMINATED_BY_AGENT for label in fates}
    return Verdict(v.victim, kind, confidence, summary, tuple(items), fates, v.oom)
