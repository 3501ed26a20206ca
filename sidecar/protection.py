"""The observer outlives the OOM it explains.

At start, where the kernel permits it:

* ``oom_score_adj`` (default -1000, ``--oom-score-adj``): the kernel's OOM killer never picks
  the daemon, however much the job takes (needs CAP_SYS_RESOURCE to go below 0);
* ``mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT)``: the daemon's pages stay in RAM, so
  under memory pressure the death path never waits for one to come back. ``MCL_ONFAULT``
  locks only pages as they are touched, so thread stacks and arenas cost what they use; the
  daemon's memory is bounded by design (``--history``, fixed-size rings), so the locked set
  is too (needs CAP_IPC_LOCK, or an RLIMIT_MEMLOCK above it);
* a higher priority (nice -10) for every thread, so two busy cores delay a postmortem less
  (needs CAP_SYS_NICE). Every thread, not the death path's alone: they share the interpreter
  lock, and the exit watcher waits for whichever thread holds it. The daemon uses about 1 %
  of a core, so this costs the job next to nothing.

What was and was not granted is logged once, shown by ``doctor`` and exported as
``trainwatch_self_protection{kind}``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

__all__ = ["DEATH_PATH_NICE", "Grant", "lock_memory", "raise_priority", "set_oom_score_adj"]

log = logging.getLogger(__name__)

DEATH_PATH_NICE = -10
_MCL_CURRENT, _MCL_FUTURE, _MCL_ONFAULT = 1, 2, 4


@dataclass(frozen=True, slots=True)
class Grant:
    kind: str  # oom_score_adj | mlock | priority
    granted: bool
    detail: str


def set_oom_score_adj(value: int, proc_self: str = "/proc/self") -> Grant:
    try:
        with open(f"{proc_self}/oom_score_adj", "w") as f:
            f.write(str(value))
        with open(f"{proc_self}/oom_score_adj") as f:
            now = int(f.read().strip())
    except OSError as exc:
        return Grant("oom_score_adj", False, f"cannot set {value}: {exc.strerror} (needs CAP_SYS_RESOURCE)")
    if now != value:
        return Grant("oom_score_adj", False, f"asked {value}, the kernel kept {now}")
    return Grant(
        "oom_score_adj",
        True,
        f"{value}" + (": the OOM killer never picks the daemon" if value == -1000 else ""),
    )


def lock_memory() -> Grant:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as exc:  # pragma: no cover - every libc has mlockall
        return Grant("mlock", False, f"no libc: {exc}")
    flags = _MCL_CURRENT | _MCL_FUTURE | _MCL_ONFAULT
    if libc.mlockall(flags) != 0:
        err = ctypes.get_errno()
        if err == 22:  # EINVAL: a kernel before 4.4 has no MCL_ONFAULT
            flags &= ~_MCL_ONFAULT
            if libc.mlockall(flags) == 0:
                return Grant("mlock", True, "all pages locked (MCL_CURRENT|MCL_FUTURE; no MCL_ONFAULT here)")
            err = ctypes.get_errno()
        why = os.strerror(err)
        return Grant("mlock", False, f"mlockall: {why} (needs CAP_IPC_LOCK or a higher RLIMIT_MEMLOCK)")
    return Grant("mlock", True, "pages locked as they are touched (MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT)")


def raise_priority(task_dir: str = "/proc/self/task") -> Grant:
    """nice -10 for every thread of the daemon (each kernel task), and so for the threads
    they start later (a new thread inherits its creator's nice). Not the death path's alone:
    Python threads share one interpreter lock, and a death-path thread waits for whichever
    thread holds it; a sampler at normal priority, preempted by the job's busy processes
    while holding it, once delayed an exit by 128 ms on the loaded benchmark."""
    failed = []
    try:
        tids = [int(t) for t in os.listdir(task_dir) if t.isdigit()]
    except OSError as exc:
        return Grant("priority", False, f"nice {DEATH_PATH_NICE} not set: {task_dir}: {exc.strerror}")
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, DEATH_PATH_NICE)
        except ProcessLookupError:
            continue  # a thread that just ended
        except OSError as exc:
            failed.append(f"task {tid}: {exc.strerror}")
    if failed:
        return Grant(
            "priority", False, f"nice {DEATH_PATH_NICE} refused ({'; '.join(failed[:3])}; needs CAP_SYS_NICE)"
        )
    return Grant("priority", True, f"nice {DEATH_PATH_NICE} for every thread of the daemon ({len(tids)} now)")
