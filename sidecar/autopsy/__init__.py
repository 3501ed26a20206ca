"""The autopsy: typed evidence in (``evidence``), the rules that name the killer
(``rules`` orders the deaths and gives the fates, ``killers`` the first death's killer,
``peers`` the other ranks, ``witnesses`` the records they weigh; ``logs`` adds what logs
alone can and cannot say), the one fold of the kernel's OOM records (``oom``) and the
advice chosen from the verdict's kind and facts (``advice``). Pure: no I/O, no clock.
The daemon and ``trainwatch diagnose`` both go through it; they differ only in how they
gather the evidence.
"""

from sidecar.autopsy.advice import RankMemory, advice
from sidecar.autopsy.evidence import (
    USERSPACE_OOM_DAEMONS,
    Evidence,
    EvidenceItem,
    Facts,
    KernelOom,
    RankState,
    SignalSent,
    UserspaceKill,
    Verdict,
    agent_name,
    rank_label,
    rank_name,
    signal_name,
)
from sidecar.autopsy.rules import autopsy

__all__ = [
    "USERSPACE_OOM_DAEMONS",
    "Evidence",
    "EvidenceItem",
    "Facts",
    "KernelOom",
    "RankMemory",
    "RankState",
    "SignalSent",
    "UserspaceKill",
    "Verdict",
    "advice",
    "agent_name",
    "autopsy",
    "rank_label",
    "rank_name",
    "signal_name",
]
