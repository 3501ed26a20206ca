"""What discovery tracks: a job (its launching process, the "agent"; run id, world size,
restarts) and its ranks; how a launcher's command line is known; the job's short key; and a
rank attached to its job (its label, where its number came from, and what its environment
tells of the job). Discovery itself (``discovery.py``) finds the processes. (What a scheduler
or launcher *says* of a job in its log is ``parse/jobs.py``.)

The launchers known by their own process (each, the mechanism that makes it one):

* ``torchrun``: torch.distributed.elastic's agent. Its ``run()`` names its main thread
  ``pt_elastic`` whatever started it (``torchrun``, ``python -m torch.distributed.run``,
  ``accelerate launch``); the command lines are known too, for a launcher that never
  renames. Its workers carry TORCHELASTIC_RUN_ID beside RANK and LOCAL_RANK.
* ``deepspeed``: DeepSpeed's per-node launcher, which its runner (the ``deepspeed``
  command) starts on every node as ``python -u -m deepspeed.launcher.launch`` (directly on
  one node, through pdsh or ssh on several). It starts each rank with ``subprocess.Popen``,
  RANK, LOCAL_RANK and WORLD_SIZE in its environment (``deepspeed/launcher/launch.py``),
  and when one exits non-zero it SIGTERMs every other rank's tree, SIGKILL after 30 s.
* ``spawn``: ``torch.multiprocessing.spawn``, from a script of any name: its children are
  ranks once they join a process group (``spawned.py`` says how they are told).
* ``mpi``: the process that starts an MPI job's ranks on a node (``_MPI_STARTERS``): Open
  MPI 4's ``mpirun``/``orterun`` (its own node's ranks are its children; ``orted`` starts
  them on the others), Open MPI 5's ``prterun``/``prted``, MPICH's ``hydra_pmi_proxy``.
  Any program may be a rank: a child with its MPI rank in its environment
  (OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK), numbered by it; the job's id is its PMIx
  namespace (Open MPI's job id), the same on every node; MPICH gives its ranks none (the
  job is then its node's proxy). A child that is a launcher itself (``mpirun torchrun
  ...``; MPICH's mpiexec, whose child hydra_pmi_proxy starts the ranks) is a job of its
  own. Debian names each implementation's starters (mpirun.openmpi, mpiexec.mpich): the
  name before the first dot counts. When a rank exits non-zero or is killed, the launcher
  aborts the job: mpirun signals every other rank (SIGCONT, SIGTERM, then SIGKILL).
* ``slurm``: ``slurmstepd``, which slurmd starts for each step of a job on each node (its
  command line reads ``slurmstepd: [JOBID.STEP]``) and which starts the step's tasks (``srun
  ...``) as its children, each with SLURM_PROCID (its rank), SLURM_LOCALID, SLURM_NTASKS,
  SLURM_JOB_ID and SLURM_STEP_ID in its environment; the job is ``JOBID.STEPID``, the same on
  every node. A batch script (no step id) is no rank. As under MPI, a task that is a launcher
  itself (``srun torchrun ...``) is a job of its own. When a task exits non-zero, the other
  tasks run on unless the step was started with ``--kill-on-bad-exit``; then Slurm signals
  them (SIGTERM, SIGKILL after KillWait).
* ``lightning``: Lightning's subprocess launcher, in the user's script, which is rank 0 and
  re-runs itself for the other local ranks (``children.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sidecar import lognames
from sidecar.errors import ProbeError
from sidecar.model import ProcKey, RankEnv
from sidecar.probes.proc import parse_rank_env

__all__ = [
    "AGENT_COMM",
    "LIGHTNING",
    "MPI",
    "OUTER",
    "SLURM",
    "SPAWN",
    "TORCHRUN",
    "TrackedJob",
    "TrackedRank",
    "agent_gone",
    "attach_rank",
    "descends_from",
    "job_key_for",
    "launcher_env",
    "launcher_of_argv",
    "rank_gone",
]

log = logging.getLogger(lognames.DISCOVERY)

AGENT_COMM = "pt_elastic"
TORCHRUN = "torchrun"
DEEPSPEED = "deepspeed"
SPAWN = "spawn"
LIGHTNING = "lightning"
MPI = "mpi"
SLURM = "slurm"
_MPI_STARTERS = frozenset({"mpirun", "mpiexec", "orterun", "orted", "prterun", "prted", "hydra_pmi_proxy"})
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
# launchers that start any program as a rank: a rank of theirs may be a launcher of its own
OUTER = frozenset({MPI, SLURM})
# python -m MODULE: the launcher it makes
_LAUNCHER_MODULES = {
    "torch.distributed.run": TORCHRUN,
    "torch.distributed.launch": TORCHRUN,
    "deepspeed.launcher.launch": DEEPSPEED,
}
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def launcher_of_argv(argv: tuple[str, ...]) -> str | None:
    """The launcher a command line starts, None for anything else: ``torchrun ...``,
    ``python /path/bin/torchrun ...``, ``python -m torch.distributed.run|launch ...``
    (torchrun); ``python -u -m deepspeed.launcher.launch ...`` (deepspeed)."""
    if not argv:
        return None
    # Debian's alternatives name each implementation's starters: mpirun.openmpi,
    # mpiexec.mpich, mpiexec.hydra (the name it was started by is the one argv keeps)
    if os.path.basename(argv[0]).split(".", 1)[0] in _MPI_STARTERS:
        return MPI
    if argv[0].startswith("slurmstepd"):  # "slurmstepd: [1234.0]"
        return SLURM
    head = argv[:3]
    if any(os.path.basename(a) == "torchrun" for a in head):
        return TORCHRUN
    # python's own options, up to the module (-m) or the script: an argument of the script
    # that happens to read "-m deepspeed.launcher.launch" starts no launcher
    i = 1
    while i < min(len(argv), 8):
        arg = argv[i]
        if arg == "-m":
            return _LAUNCHER_MODULES.get(argv[i + 1]) if i + 1 < len(argv) else None
        if arg.startswith("-m"):
            return _LAUNCHER_MODULES.get(arg[2:])
        if arg == "-c" or not arg.startswith("-"):
            return None  # a command string, or the script
        i += 2 if arg in ("-W", "-X", "-Q") else 1  # an option, and its value if it takes one
    return None


def is_worker(launcher: str, env: RankEnv) -> bool:
    """Whether a child of ``launcher`` with this environment is one of its ranks (not a
    helper it started, nor a process between fork and exec that still has the launcher's
    own environment): torchrun's workers carry its run id; DeepSpeed's their RANK or
    LOCAL_RANK, which the launcher's own environment lacks."""
    if launcher == TORCHRUN:
        return env.is_worker
    if launcher == SPAWN:
        return False  # its environment is its parent's: a group's threads tell (spawned.py)
    if launcher in OUTER:  # Slurm's tasks of a step, MPI's ranks (a batch script has no step)
        return env.rank is not None and env.rank_var != "RANK"
    if launcher == LIGHTNING:  # LOCAL_RANK >= 1 and no RANK nor run id (children.py)
        return env.local_rank is not None and env.local_rank >= 1 and env.rank is None and env.run_id is None
    return env.rank is not None or env.local_rank is not None


# the launchers that give a rank its identity in variables of their own: the variables its
# rank, its local rank and the world size may be in, first found first
_GIVEN = {
    SLURM: (("SLURM_PROCID",), ("SLURM_LOCALID",), ("SLURM_NTASKS", "SLURM_NPROCS")),
    MPI: (
        _MPI_RANK_VARS,
        ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
        ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    ),
}


def launcher_env(launcher: str, raw: dict[str, str]) -> RankEnv:
    """A child's identity as its launcher gives it: a Slurm task's or an MPI rank's from its
    launcher's variables (RANK, which neither sets, is not read for them; a batch script has
    no step, so no rank); any other's from RANK, LOCAL_RANK..."""
    env = parse_rank_env(raw)
    if launcher not in _GIVEN:
        return env
    ranks, local_ranks, sizes = _GIVEN[launcher]

    def first(names: tuple[str, ...]) -> str | None:
        return next((raw[v] for v in names if raw.get(v, "").isdigit()), None)

    var = next((v for v in ranks if raw.get(v, "").isdigit()), None)
    step = raw.get("SLURM_STEP_ID", "")
    if launcher == SLURM and not step.isdigit():
        var = None
    job_id = f"{raw.get('SLURM_JOB_ID', '?')}.{step}" if launcher == SLURM else None
    local, size = first(local_ranks), first(sizes)
    return dataclasses.replace(
        env,
        rank=int(raw[var]) if var else None,
        rank_var=var or "RANK",
        local_rank=int(local) if local else None,
        world_size=int(size) if size else None,
        run_id=(job_id or raw.get("PMIX_NAMESPACE") or raw.get("OMPI_MCA_ess_base_jobid")) if var else None,
        local_world_size=None,
        group_rank=None,
    )


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
    # where its number came from: the variable of its environment (RANK, LOCAL_RANK), or
    # "order" (its environment unreadable: its place among the launcher's children)
    rank_source: str = "order"

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
    launcher: str = TORCHRUN
    # watched by `trainwatch run` only for the tasks that carry its marker (Discovery.marker)
    by_marker: bool = False


def attach_rank(
    job: TrackedJob,
    jobs: Iterable[TrackedJob],
    key: ProcKey,
    env: RankEnv | None,
    entrypoint: str | None,
    now: float,
    order: int | None = None,
    given: str | None = None,
) -> TrackedRank:
    """The rank ``key`` joins ``job``: its label (its RANK, else its local rank, else its
    order), and the job's key, world size and restarts as its environment tells them.
    ``jobs``: every tracked job (two jobs never share a key). ``order``: its place among
    the launcher's children, where the launcher gives it no other number (spawn's);
    ``given``: where its number came from, where its launcher's rule says (Lightning's)."""
    pid = key.pid
    if order is not None:
        label, source = f"local{order}", "order"
    elif env is not None and env.rank is not None:
        label, source = str(env.rank), env.rank_var
    elif env is not None and env.local_rank is not None:
        label, source = f"local{env.local_rank}", "LOCAL_RANK"
    else:
        label, source = f"local{len(job.ranks)}", "order"
    source = given or source  # where the launcher's own rule puts it (Lightning's)
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
    rank = job.ranks[pid] = TrackedRank(key, env, label, entrypoint, now, source)
    log.info(
        "job %s: attached rank %s (local_rank %s, restart %d) pid %d%s%s",
        job.key,
        label,
        env.local_rank if env else "?",
        env.restart_count if env else 0,
        pid,
        f" running {entrypoint}" if entrypoint else "",
        "" if job.launcher == TORCHRUN else f" (launched by {job.launcher})",
    )
    return rank


def agent_gone(jobs: dict[int, TrackedJob], pid: int) -> None:
    """The job's launching process exited: the job ends with it, or (its ranks still
    running: torchrun's workers are session leaders of their own, they outlive a killed
    agent and still hold their memory) when the last of them exits."""
    job = jobs.get(pid)
    if job is None:
        return
    if pid in job.ranks:  # the launching process was a rank too (Lightning's rank 0)
        rank_gone(jobs, pid, pid)
        if pid not in jobs:
            return
    if job.ranks:
        job.agent_alive = False
        log.warning(
            "job %s: the agent (pid %d) exited but %d rank(s) still run; watching them until they exit",
            job.key,
            pid,
            len(job.ranks),
        )
    else:
        del jobs[pid]
        log.info("job %s: agent pid %d exited, detached", job.key or f"(agent {pid})", pid)


def rank_gone(jobs: dict[int, TrackedJob], agent_pid: int, pid: int) -> None:
    """A rank exited; the job ends with its last rank once its agent is gone."""
    job = jobs.get(agent_pid)
    rank = job.ranks.pop(pid, None) if job else None
    if job is not None and rank is not None:
        log.info("job %s: rank %s (pid %d) exited", job.key, rank.label, pid)
        if not job.agent_alive and not job.ranks:
            del jobs[agent_pid]
            log.info("job %s: the last orphaned rank exited, detached", job.key)


def descends_from(pid: int, pids: frozenset[int], parent_of: Callable[[int], int]) -> bool:
    """Whether ``pid`` or one of its ancestors (up to 64 levels) is in ``pids``.
    ``parent_of`` raises ProbeError for a process gone."""
    at: int | None = pid
    for _ in range(64):
        if at is None:
            return False
        if at in pids:
            return True
        try:
            ppid = parent_of(at)
        except ProbeError:
            return False
        at = ppid if ppid != at and ppid > 0 else None
    return False
