"""What discovery tracks: a torchrun job (its agent, run id, world size, restarts) and its
ranks; how an agent's command line is known; the job's short key; and a rank attached to its
job (its label, and what its environment tells of the job). Discovery itself (``discovery.py``)
finds the processes.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from sidecar.model import ProcKey, RankEnv

__all__ = ["AGENT_COMM", "TrackedJob", "TrackedRank", "attach_rank", "is_agent_argv", "job_key_for"]

log = logging.getLogger("sidecar.discovery")

AGENT_COMM = "pt_elastic"
_AGENT_MODULES = {"torch.distributed.run", "torch.distributed.launch"}
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def is_agent_argv(argv: tuple[str, ...]) -> bool:
    """True for the command lines of a torchrun agent: ``torchrun ...``, ``python
    /path/bin/torchrun ...``, ``python -m torch.distributed.run|launch ...``."""
    if not argv:
        return False
    head = argv[:3]
    if any(os.path.basename(a) == "torchrun" for a in head):
        return True
    for i, arg in enumerate(argv[:6]):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in _AGENT_MODULES:
            return True
        if arg.startswith("-m") and arg[2:] in _AGENT_MODULES:
            return True
    return False


def job_key_for(run_id: str | None, agent_pid: int) -> str:
    """The short, stable ``job`` label: the rendezvous id when one was given (the first
    8 hex digits of a ``--standalone`` uuid), else the agent's pid. torchrun's default
    id without ``--rdzv-id`` is the literal ``none``, which is no id."""
    if run_id and run_id.lower() != "none":
        return run_id[:8] if _UUID.match(run_id) else run_id
    return str(agent_pid)


@dataclass(slots=True)
class TrackedRank:
    key: ProcKey
    env: RankEnv | None
    label: str
    entrypoint: str | None
    attached_at: float

    @property
    def rank(self) -> int | None:
        return self.env.rank if self.env else None

    @property
    def local_rank(self) -> int | None:
        return self.env.local_rank if self.env else None

    @property
    def restart(self) -> int:
        return self.env.restart_count if self.env else 0


@dataclass(slots=True)
class TrackedJob:
    agent: ProcKey
    agent_argv: tuple[str, ...]
    started_at: float
    key: str | None = None
    run_id: str | None = None
    world_size: int | None = None
    restart_count: int = 0
    max_restarts: int | None = None
    entrypoint: str | None = None
    ranks: dict[int, TrackedRank] = field(default_factory=dict)
    agent_alive: bool = True


def attach_rank(
    job: TrackedJob,
    jobs: Iterable[TrackedJob],
    key: ProcKey,
    env: RankEnv | None,
    entrypoint: str | None,
    now: float,
) -> TrackedRank:
    """The rank ``key`` joins ``job``: its label (its RANK, else its local rank, else its
    order), and the job's key, world size and restarts as its environment tells them.
    ``jobs``: every tracked job (two jobs never share a key)."""
    pid = key.pid
    if env is not None and env.rank is not None:
        label = str(env.rank)
    elif env is not None and env.local_rank is not None:
        label = f"local{env.local_rank}"
    else:
        label = f"local{len(job.ranks)}"
    if job.key is None:
        run_id = env.run_id if env else None
        job_key = job_key_for(run_id, job.agent.pid)
        if any(other.key == job_key for other in jobs if other is not job):
            job_key = f"{job_key}-{job.agent.pid}"
        job.key = job_key
        job.run_id = run_id if run_id and run_id.lower() != "none" else None
    if env is not None:
        job.world_size = env.world_size
        job.max_restarts = env.max_restarts
        if env.restart_count > job.restart_count:
            log.info("job %s: restart %d, a new generation of workers", job.key, env.restart_count)
        job.restart_count = max(job.restart_count, env.restart_count)
    job.entrypoint = job.entrypoint or entrypoint
    rank = job.ranks[pid] = TrackedRank(key, env, label, entrypoint, now)
    log.info(
        "job %s: attached rank %s (local_rank %s, restart %d) pid %d%s",
        job.key,
        label,
        env.local_rank if env else "?",
        env.restart_count if env else 0,
        pid,
        f" running {entrypoint}" if entrypoint else "",
    )
    return rank
