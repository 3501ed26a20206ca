"""The children of ``torch.multiprocessing.spawn``, on their way to being ranks.

``torch.multiprocessing.spawn`` (and ``start_processes`` with the spawn method) is called
from a script of any name. Each process it starts is a fresh interpreter running
``python -c "from multiprocessing.spawn import spawn_main; ..." --multiprocessing-fork``
(``multiprocessing.spawn.get_command_line``), started in index order; its index ``i``
reaches it only as an argument of the function it runs, and its environment is its
parent's: a rank's RANK, MASTER_ADDR... are set in the child's ``os.environ``, which
``/proc/PID/environ`` never shows (PyTorch's DDP tutorial does exactly this). A DataLoader
worker or a pool of the spawn context looks the same. So a spawned child outside every
job's tree **waits** (``Spawned``) and is a rank only once it has **joined a
torch.distributed process group**: c10d names the threads it starts for one
(``pt_gloo_runloop`` and gloo's own ``gloo_tcp_loop``, ``pt_nccl_watchdg`` and the other
``pt_nccl*``, ``pt_tcpstore*`` for a store's server). Its number is its index among its
parent's spawned children (``rank_source`` ``order``); its parent becomes the job's
launching process. A child that has not joined within ``SPAWN_JOIN_SECONDS`` of its start
is a helper. When one rank exits non-zero, the parent's ``join`` SIGTERMs the others at
once, SIGKILL after 30 s (``torch/multiprocessing/spawn.py``).

(The forkserver and fork methods start children that are no fresh interpreters: not
found this way.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from sidecar.errors import ProbeError
from sidecar.model import RankEnv
from sidecar.probes.proc import ProcReader, parse_rank_env

__all__ = ["SPAWN_JOIN_SECONDS", "Spawned", "is_spawned", "joined_group", "spawned_env"]

# How long a spawned child may take to join a process group (its interpreter's start, its
# imports: torch and a model library take tens of seconds on a loaded node) before it is
# taken for a helper of the spawn context.
SPAWN_JOIN_SECONDS = 120.0
# The names c10d gives the threads it starts for a process group or a store
# (c10::setThreadName in ProcessGroupGloo, gloo's device loop, ProcessGroupNCCL's watchdog
# and heartbeat monitor, TCPStore's server), and those of the other backends' groups.
GROUP_THREAD_PREFIXES = ("pt_gloo", "gloo_tcp", "pt_nccl", "pt_tcpstore", "pt_xccl", "pt_ucc")


def is_spawned(argv: tuple[str, ...]) -> bool:
    """Whether a command line is a child of multiprocessing's spawn start method:
    ``python [flags] -c "from multiprocessing.spawn import spawn_main; spawn_main(...)"
    --multiprocessing-fork``."""
    return (
        len(argv) >= 3
        and argv[-1] == "--multiprocessing-fork"
        and argv[-3] == "-c"
        and argv[-2].startswith("from multiprocessing.spawn import spawn_main")
    )


def joined_group(thread_names: Iterable[str]) -> bool:
    """Whether a process's threads show it in a torch.distributed process group (or
    serving its store): c10d names the threads it starts for one."""
    return any(name.startswith(GROUP_THREAD_PREFIXES) for name in thread_names)


def spawned_env(env: RankEnv, index: int) -> RankEnv:
    """A spawned rank's identity: its index among its parent's spawned children. Its
    environment is the parent's, so any RANK, LOCAL_RANK, WORLD_SIZE or run id in it are
    the parent's, not this child's: dropped."""
    return dataclasses.replace(
        env, rank=None, local_rank=index, world_size=None, local_world_size=None, group_rank=None, run_id=None
    )


class Spawned:
    """The spawned children waiting to join a group, each with its index (its place among
    its parent's spawned children: discovery hands them over in start order)."""

    def __init__(self, reader: ProcReader) -> None:
        self.reader = reader
        self.waiting: dict[int, int] = {}  # pid -> index
        self._count: dict[int, int] = {}  # parent pid -> spawned children seen

    def wait(self, pid: int, ppid: int) -> None:
        index = self._count.get(ppid, 0)
        self._count[ppid] = index + 1
        self.waiting[pid] = index

    def forget(self, pid: int) -> None:
        """The process is gone, or no longer waits (a child, or a parent)."""
        self.waiting.pop(pid, None)
        self._count.pop(pid, None)

    def check(self, pid: int, age: float) -> tuple[int, RankEnv | None] | None:
        """A child that joined a group by now: its index, and its environment as a spawned
        rank's (None where unreadable: its index still numbers it); it no longer waits.
        None while it waits, and once it has waited ``SPAWN_JOIN_SECONDS`` (it no longer
        does: a helper)."""
        try:
            joined = joined_group(self.reader.thread_names(pid))
        except ProbeError:
            return None  # unreadable for now, or gone (the next listing forgets it)
        if not joined:
            if age > SPAWN_JOIN_SECONDS:
                self.waiting.pop(pid, None)
            return None
        index = self.waiting.pop(pid)
        try:
            return index, spawned_env(parse_rank_env(self.reader.environ(pid)), index)
        except ProbeError:
            return index, None
