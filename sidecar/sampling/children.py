"""Discovery's part for the launchers known only by the children they start: the script
that calls ``torch.multiprocessing.spawn`` and Lightning's subprocess launcher. Neither
process is a launcher by its name or its command line (each is the user's script); each
becomes a job's launching process when a child of it shows what it is.

* **spawn** (``spawned.py`` tells how): a spawned child outside every job's tree waits until
  it joins a process group, then is a rank numbered by its order; its parent is the job's.
* **lightning**: Lightning's ``_SubprocessScriptLauncher`` (``lightning/fabric/strategies/
  launchers/subprocess_script.py``) runs in the main process, which is **rank 0 itself**:
  it sets MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK and WORLD_SIZE in its own
  ``os.environ`` (which ``/proc/PID/environ`` never shows) and re-runs its own program
  (``sys.executable``, the script's absolute path or ``-m`` module, the same arguments) with
  ``subprocess.Popen`` once per other local rank, each with ``LOCAL_RANK=i`` (i >= 1) in its
  environment, and never RANK. So a python child that runs its parent's program with
  LOCAL_RANK >= 1 and NODE_RANK but no RANK (nor torchrun's run id), where its parent's own
  environment has no LOCAL_RANK (a worker forked from a Lightning rank has its parent's,
  LOCAL_RANK included), makes its parent a Lightning job: the parent is its local rank 0
  (``rank_source`` ``order``), each such child its LOCAL_RANK; on node 0 (NODE_RANK 0) the
  global rank is the local rank. Rank 0's other children never qualify (its spawn-context
  DataLoader workers and subprocesses inherit LOCAL_RANK=0). A thread of rank 0 polls the
  children every 5 s and, when one exits non-zero, SIGKILLs the others and rank 0 itself;
  when rank 0 dies, nothing ends its children.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from sidecar.errors import ProbeError
from sidecar.model import RankEnv
from sidecar.probes.proc import entrypoint_of, parse_rank_env
from sidecar.sampling import jobs
from sidecar.sampling.jobs import attach_rank
from sidecar.sampling.spawned import Spawned, is_spawned

if TYPE_CHECKING:
    from sidecar.sampling.discovery import Discovery, _Entry

__all__ = ["ByChildren", "lightning_rank", "relaunched"]


def relaunched(argv: tuple[str, ...], parent_argv: tuple[str, ...]) -> bool:
    """Whether ``argv`` is a python interpreter running ``parent_argv``'s program again:
    the same script (by name: the child gets its absolute path) or ``-m`` module, and the
    same arguments after it."""
    if not argv or not parent_argv or not os.path.basename(argv[0]).startswith("python"):
        return False
    mine, theirs = entrypoint_of(argv), entrypoint_of(parent_argv)
    if mine is None or theirs is None:
        return False
    if mine.startswith("-m ") or theirs.startswith("-m "):
        same = mine == theirs
    else:
        same = os.path.basename(mine) == os.path.basename(theirs)
    return same and _after(argv, mine) == _after(parent_argv, theirs)


def _after(argv: tuple[str, ...], entrypoint: str) -> tuple[str, ...] | None:
    """The arguments after the entry point (``entrypoint_of``'s: a script, or ``-m module``)."""
    token = entrypoint[3:] if entrypoint.startswith("-m ") else entrypoint
    return argv[argv.index(token) + 1 :] if token in argv else None


def lightning_rank(env: RankEnv) -> RankEnv:
    """A Lightning rank's identity: its global rank is NODE_RANK x (ranks per node) +
    LOCAL_RANK (``LightningEnvironment.global_rank``), so on node 0 it is its LOCAL_RANK;
    elsewhere the ranks per node are not in the environment, and it has none."""
    return dataclasses.replace(env, rank=env.local_rank if env.node_rank == 0 else None)


class ByChildren:
    """Reads and changes its discovery's state (it is a part of it, kept apart for size)."""

    def __init__(self, d: Discovery) -> None:
        self.d = d
        self.spawned = Spawned(d.reader)

    def claim(self, entry: _Entry, argv: tuple[str, ...]) -> bool:
        """A process outside every job that its parent's launcher shows for what it is: a
        spawned child (it waits), a Lightning child (its parent becomes the job)."""
        d = self.d
        parent = d.entries.get(entry.ppid)
        if parent is None or entry.ppid in d._watched:
            return False
        if is_spawned(argv):
            if parent.kind == "agent":  # a spawn job's parent starting one more
                job = d.jobs.get(entry.ppid)
                if job is None or job.launcher != jobs.SPAWN:
                    return False
            elif parent.kind not in ("new", "other"):
                return False
            entry.kind = "spawned"
            d._young.discard(entry.key.pid)
            self.spawned.wait(entry.key.pid, entry.ppid)
            self.check_spawned(entry)
            return True
        if parent.kind in ("new", "other") and self._lightning_child(entry, argv, parent):
            d._young.discard(entry.key.pid)
            d.make_agent(parent, jobs.LIGHTNING)
            return True
        return False

    def _lightning_child(self, entry: _Entry, argv: tuple[str, ...], parent: _Entry) -> bool:
        """Its parent's program again, with Lightning's variables that its parent's own
        environment lacks (the parent set them in its ``os.environ``): a process forked from
        a Lightning rank (a DataLoader worker) has the same program and its parent's
        environment, LOCAL_RANK included, and is no new rank."""
        reader = self.d.reader
        if not argv or not os.path.basename(argv[0]).startswith("python"):
            return False  # no read for the shells and tools a node starts by the thousand
        try:
            if not relaunched(argv, reader.cmdline(parent.key.pid)):
                return False
            raw = reader.environ(entry.key.pid)
            if "NODE_RANK" not in raw or not jobs.is_worker(jobs.LIGHTNING, parse_rank_env(raw)):
                return False
            return "LOCAL_RANK" not in reader.environ(parent.key.pid)
        except ProbeError:
            return False

    def adopt_parent(self, job: jobs.TrackedJob, child_env: RankEnv | None) -> None:
        """A Lightning job's launching process is its local rank 0: attached as a rank too,
        numbered by its place (the first), the world size its children's."""
        d = self.d
        if job.agent.pid in job.ranks:
            return
        env = RankEnv(
            rank=0 if child_env is not None and child_env.node_rank == 0 else None,
            local_rank=0,
            world_size=child_env.world_size if child_env else None,
            local_world_size=None,
            group_rank=None,
            role=None,
            run_id=None,
            restart_count=0,
            max_restarts=None,
            error_file=None,
            node_rank=child_env.node_rank if child_env else None,
        )
        entrypoint = entrypoint_of(job.agent_argv)
        attach_rank(job, d.jobs.values(), job.agent, env, entrypoint, d.wall(), given="order")

    def check(self) -> None:
        """Every listing: the spawned children still waiting."""
        entries = self.d.entries
        for pid in list(self.spawned.waiting):
            entry = entries.get(pid)
            if entry is None or entry.kind != "spawned":
                self.spawned.waiting.pop(pid, None)
            else:
                self.check_spawned(entry)

    def check_spawned(self, entry: _Entry) -> None:
        """A rank once it joined a group (its parent then the job's launching process);
        a helper once it has taken too long."""
        d = self.d
        joined = self.spawned.check(entry.key.pid, d.age(entry))
        if joined is None:
            if entry.key.pid not in self.spawned.waiting:
                entry.kind = "other"  # it took too long: a helper of the spawn context
            return
        index, env = joined
        parent = d.entries.get(entry.ppid)
        if parent is not None and parent.kind != "agent":
            d.make_agent(parent, jobs.SPAWN)
        job = d.jobs.get(entry.ppid)
        if job is None or job.launcher != jobs.SPAWN:  # its parent is no launching process after all
            entry.kind = "other"
            return
        entry.kind = "rank"
        entrypoint = entrypoint_of(job.agent_argv)  # the script that called spawn
        attach_rank(job, d.jobs.values(), entry.key, env, entrypoint, d.wall(), index)
        d._dirty = True

    def forget(self, pid: int) -> None:
        self.spawned.forget(pid)
