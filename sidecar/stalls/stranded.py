"""Stranded survivors: ranks left alive and going nowhere after another rank of their job died.

A death does not always end a job. torchrun's agent, DeepSpeed's launcher and
``torch.multiprocessing.spawn``'s parent end the other ranks of their node at once; but a
Slurm step without ``--kill-on-bad-exit`` leaves them running, Lightning's ranks are
orphaned when its rank 0 (their parent) dies, and the ranks of a job's other agents (its
other nodes) never hear of it. A survivor blocked on the dead rank (in a collective, a
store's wait, a barrier) then holds its GPUs until a timeout 10 to 30 minutes later.

A live rank is **stranded** when

* another rank of its job died abnormally: a death the death watch counted
  (``DeathLedger.times``) in its job and worker generation, or in another job here with
  the same launcher id (another agent of a multi-node job, run on this node); and
* the stall tracker (``tracker.py``) judges it making no progress (idle: no CPU and no GPU;
  its GPU busy while a peer's is silent; in a collective that completed nothing between
  flight-recorder dumps), and it has made none for ``STRANDED_AFTER_S`` since the later of
  the death and its last progress. (The tracker judges over a window of a few seconds: a
  rank judged idle now has been idle that window already, so its last progress is the last
  round judged working less the window.)

Never on a job in which no rank died: a long checkpoint, an eval, a pause of every rank is
no stranding. A survivor that keeps working after the death (fault-tolerant training that
shrinks its world, a rank saving its own checkpoint) makes progress and is not stranded. A
rank spinning its GPU in an NCCL collective looks busy: it makes no progress when its GPU
spins (the stall tracker's ``gpu_spinning_seconds``: a kernel resident in every sample of
the window, no memory traffic in any, as a kernel polling for a dead peer's data), counted
from when the spinning began; or where its job's flight recorder can be asked
(``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``) and shows the collective going nowhere.

The stranding is the job's ``stranded`` (``/ranks``, the ``trainwatch_job_stranded_*``
metrics) and, told to the death watch (``on_stranded``), the survivors' fate ``stranded``
in the death's postmortem, added when seen: the postmortem is never delayed for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from sidecar import lognames
from sidecar.model import JobSample, Snapshot, Stranding, evolve
from sidecar.model.ledger import DeathKey

__all__ = ["STRANDED_AFTER_S", "StrandTracker"]

log = logging.getLogger(lognames.STRANDED)

STRANDED_AFTER_S = 10.0
_KEPT_JOBS = 256  # the launcher ids of jobs gone, kept to tie a death to another agent's ranks

# (job, rank label, restart) -> (killer, wall time): the deaths the death watch counted
DeathTimes = Mapping[DeathKey, tuple[str, float]]


class StrandTracker:
    """Judges every job of a round (the sampler's thread, after the stall tracker)."""

    def __init__(
        self,
        death_times: Callable[[], DeathTimes],
        on_stranded: Callable[[str, int, dict[int, float]], None] | None = None,
        wall: Callable[[], float] = time.time,
        window: float = 0.0,
    ) -> None:
        """``window``: the stall tracker's judging window (``StallTracker.window``)."""
        self.death_times = death_times
        self.window = window
        self.on_stranded = on_stranded
        self.wall = wall
        self._run_ids: dict[str, str] = {}  # job key -> its launcher id, for jobs seen
        self._told: dict[str, set[int]] = {}  # job key -> the pids told stranded
        # the deaths by (job, restart), built again only when the death watch swaps its ledger
        self._indexed: DeathTimes | None = None
        self._by_job: dict[tuple[str, int], list[tuple[str, float]]] = {}

    def update(self, snap: Snapshot) -> Snapshot:
        for job in snap.jobs:  # an agent may be gone by the time its rank's death is counted
            if job.run_id and self._run_ids.get(job.key) != job.run_id:
                self._run_ids[job.key] = job.run_id
                while len(self._run_ids) > _KEPT_JOBS:
                    del self._run_ids[next(iter(self._run_ids))]
        deaths = self.death_times()
        if not deaths and not self._told:
            return snap  # no death anywhere: nothing can be stranded
        now = self.wall()
        jobs = tuple(self._judge(job, deaths, now) for job in snap.jobs)
        live = {job.key for job in snap.jobs}
        for key in [k for k in self._told if k not in live]:
            del self._told[key]
        return evolve(snap, jobs=jobs)

    def _deaths_of(self, job: JobSample, deaths: DeathTimes) -> list[tuple[str, float]]:
        """The abnormal deaths of the job's generation: its own, and those of another job
        here with its launcher id (another agent of the same multi-node job)."""
        if deaths is not self._indexed:
            self._indexed, self._by_job = deaths, {}
            for (key, label, restart), (_killer, at) in deaths.items():
                self._by_job.setdefault((key, restart), []).append((label, at))
        out = list(self._by_job.get((job.key, job.restart_count), ()))
        if job.run_id is not None:
            for (key, restart), died in self._by_job.items():
                if key != job.key and restart == job.restart_count and self._run_ids.get(key) == job.run_id:
                    out += [(f"{label} (job {key})", at) for label, at in died]
        return out

    def _judge(self, job: JobSample, deaths: DeathTimes, now: float) -> JobSample:
        died = self._deaths_of(job, deaths)
        if not died:
            return job if job.stranded is None else evolve(job, stranded=None)
        first = min(at for _, at in died)
        stranded = []
        for r in job.ranks:
            p = r.progress
            if p is None:
                continue  # too new to judge
            if p.reason is not None:
                since = max(first, now - p.stalled_seconds - self.window)
            elif p.gpu_spinning_seconds > 0:  # busy, polling for a peer: no progress
                since = max(first, now - p.gpu_spinning_seconds)
            else:
                continue  # it makes progress
            if now - since >= STRANDED_AFTER_S:
                stranded.append((r, since))
        if not stranded:
            return job if job.stranded is None else evolve(job, stranded=None)
        found = Stranding(
            since=min(since for _, since in stranded),
            dead_ranks=tuple(sorted({label for label, _ in died})),
            ranks=tuple(r.rank_label for r, _ in stranded),
            pids=tuple(r.key.pid for r, _ in stranded),
            gpu_memory_bytes=sum(sum(r.gpu_memory_bytes.values()) for r, _ in stranded),
        )
        told = self._told.setdefault(job.key, set())
        fresh = {r.key.pid: since for r, since in stranded if r.key.pid not in told}
        if fresh:
            told.update(fresh)
            log.warning(
                "job %s: rank(s) %s stranded: alive and making no progress %.0f s after rank(s) %s died%s",
                job.key,
                ", ".join(r.rank_label for r, _ in stranded if r.key.pid in fresh),
                now - first,
                ", ".join(found.dead_ranks),
                f"; they hold {found.gpu_memory_bytes / 2**30:.1f} GiB of GPU memory"
                if found.gpu_memory_bytes
                else "",
            )
            if self.on_stranded is not None:
                self.on_stranded(job.key, job.restart_count, fresh)
        return evolve(job, stranded=found)
