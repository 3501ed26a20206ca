"""Stalls before the timeout: ranks that stopped making progress, and who they wait for.

Users should not wait the 10-30 minutes of a collective timeout to learn that a job hung.
Each round every rank is judged over a window of a few seconds (CPU time moves in 10 ms
ticks, and ranks keep background threads):

* **working**: it used more than ``IDLE_CORE_FRACTION`` of a core, or its GPU ran kernels
  (NVML per-process SM activity of at least ``GPU_BUSY_PERCENT`` on average), and is not
  waiting as below;
* **idle**: neither. A rank blocked in a gloo collective, a sleep or a lock uses no CPU and
  no GPU;
* **collective**: every rank's GPU busy (ranks spinning in a collective for a rank on another
  node look so, and so does work), and the flight recorder, asked through the job's own FIFO
  where the job set one (every third of ``--stall-after``, at least 5 s: one dump per rank),
  shows a collective pending and none completed since the last dump: the ranks with one
  pending are stalled since the last dump that still moved;
* **waiting**: its GPU is busy while a peer's GPU ran no kernel at all in the window. A
  collective needs every rank, and a rank stuck in an NCCL collective keeps its GPU at
  100 % (the kernel spins on the peer's data), so without this it looks busy: every step of
  a job's ranks launches kernels on each GPU, and a peer whose GPU is silent for the
  whole window cannot be taking part in the collective the busy ones run.

Beside these, a rank is **spinning** when every NVML sample of its GPU in the whole window
shows a kernel resident at least ``SPIN_SM_PERCENT`` of the time and none shows memory
traffic: a polling loop, as an NCCL kernel waiting for a peer's data is (measured on an
H200: 99-100 % SM and 0 % memory in every sample, where training steps left gaps to 0 %
SM; benchmarks/results/gpu-stall-h200.json). Alone it is no stall (a job's ranks all
spinning look so while they work, and a saturated kernel may move little memory); after a
peer's death it is no progress (``stranded.py``).

A rank is stalled for as long as it has been idle, waiting or stuck in a collective; the
job's ``stalled_seconds`` is its longest-stalled rank's. The ranks the stalled ones wait for
(``suspected_missing``): the GPU-silent peers of waiting ranks; the ranks the flight recorder
shows never entering the pending collective; else the ranks still working while others idle;
at the snapshot, the ranks whose Python stack is outside ``torch.distributed`` while the
others' are inside it, and the ranks the flight recorder shows never entering the
collective the others wait in.

When a job's stall reaches the threshold (``--stall-after``), once per episode, a thread
of its own (never the sampler's) takes the **snapshot**: each rank's Python stack with
``py-spy dump --nonblocking`` (reads the rank's memory without pausing it; on by default
where py-spy is installed and ptrace is permitted), a flight-recorder dump requested
through the job's own trigger where it set one (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``: the
NCCL monitor dumps when a byte is written into ``<prefix><rank>.pipe``) and read back, and
each rank's CPU and GPU activity. The job's next postmortem carries it as ``stall``, so the
missing rank's stack is there even when that rank was later SIGKILLed.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar import lognames
from sidecar.model import JobSample, RankProgress, RankSample, Snapshot, evolve
from sidecar.model.stall import StallSnapshot
from sidecar.parse.flight import summarise
from sidecar.stalls.stacks import (
    collect_dumps,
    py_spy_status,
    rank_stacks,
    read_flight,
    request_flight,
    snapshot_of,
)

__all__ = ["GPU_BUSY_PERCENT", "IDLE_CORE_FRACTION", "StallTracker"]

log = logging.getLogger(lognames.STALLS)

IDLE_CORE_FRACTION = 0.05
GPU_BUSY_PERCENT = 5.0
SPIN_SM_PERCENT = 90.0  # a polling kernel's measured floor was 99 %; a margin for sampling
WINDOW_SECONDS = (2.0, 10.0)
ENDED_KEPT_S = 30.0  # a stall that ended this recently still preceded a death
# While every rank's GPU is busy, nothing local tells a job that works from ranks spinning in
# a collective for a rank on another node; where the job set its flight recorder's FIFO, ask
# it this often (at least; a third of --stall-after) whether any collective completed.
PROBE_EVERY_S = 5.0

REASONS = {
    "idle": "no CPU and no GPU use",
    "waiting": "its GPU busy while a peer's GPU ran nothing: waiting in a collective",
    "collective": "in a collective that completed nothing between flight-recorder dumps",
}


@dataclass
class _Rank:
    # (at, cpu s, GPU SM %, GPU memory %)
    history: collections.deque[tuple[float, float, float | None, float | None]]
    last_progress: float
    spin_since: float | None = None  # judged spinning since (its window's start)


@dataclass
class _Job:
    ranks: dict[int, _Rank] = field(default_factory=dict)  # pid ->
    reported: bool = False
    episode: int = 0  # counts the stalls reported, so a late snapshot lands only in its own
    snapshot: StallSnapshot | None = None  # the stall's, while it lasts
    # the flight recorder asked while every rank's GPU is busy (probe_flight): each
    # (rank, process group) -> (last enqueued, last completed) at the last probe, and since
    # when (monotonic) no collective has completed on any rank while some are pending
    probing: bool = False
    probe_next: float = 0.0
    probe_last: dict[tuple[int, str], tuple[int, int]] | None = None
    probe_last_at: float = 0.0
    fr_stuck_since: float | None = None
    fr_pending: frozenset[str] = frozenset()  # rank labels with a collective pending
    fr_behind: frozenset[str] = frozenset()  # rank labels that never entered the newest one
    dumps_seen: dict[int, float] = field(default_factory=dict)  # rank -> mtime of the last dump read


@dataclass(frozen=True, slots=True)
class _Judged:
    fresh: bool
    cpu_busy: bool
    gpu_busy: bool | None
    gpu_silent: bool  # GPU data for the whole window, and no kernel ran


class StallTracker:
    def __init__(
        self,
        threshold_seconds: float,
        *,
        py_spy: bool | None = None,
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.threshold = threshold_seconds
        self.clock = clock
        self.wall = wall
        self.proc_root = proc_root
        self.window = max(WINDOW_SECONDS[0], min(WINDOW_SECONDS[1], threshold_seconds / 2))
        self.py_spy, self.no_stacks = py_spy_status(py_spy, proc_root)
        if py_spy and self.py_spy is None:
            log.warning("stalls: --py-spy given but %s: no stacks", self.no_stacks)
        self._jobs: dict[str, _Job] = {}
        self._fr_locks: dict[str, threading.Lock] = {}  # per job: one flight-recorder request at a time
        self._lock = threading.Lock()

    # -- the sampler's side ----------------------------------------------------------------

    def update(self, snap: Snapshot) -> Snapshot:
        """Sampler thread: the snapshot with each rank's progress and each job's stall."""
        now = self.clock()
        jobs = []
        live = set()
        for job in snap.jobs:
            live.add(job.key)
            with self._lock:
                state = self._jobs.setdefault(job.key, _Job())
            jobs.append(self._judge(job, state, now))
        with self._lock:
            for key in [k for k in self._jobs if k not in live]:
                del self._jobs[key]
                self._fr_locks.pop(key, None)
        return evolve(snap, jobs=tuple(jobs))

    def _window(self, r: RankSample, state: _Job, now: float) -> _Judged:
        rank = state.ranks.get(r.key.pid)
        if rank is None:
            rank = state.ranks[r.key.pid] = _Rank(collections.deque(), now)
        h = rank.history
        h.append((now, r.cpu_seconds, r.gpu_sm_percent, r.gpu_memory_percent))
        while len(h) > 2 and h[1][0] <= now - self.window:
            h.popleft()
        at, cpu, _, _ = h[0]
        if now - at < self.window:
            rank.spin_since = None
            return _Judged(True, True, None, False)  # too new to judge (a start, a restart)
        cpu_busy = (r.cpu_seconds - cpu) / (now - at) > IDLE_CORE_FRACTION
        recent = list(h)[1:]
        sms = [sm for _, _, sm, _ in recent if sm is not None]
        if not sms:
            rank.spin_since = None
            return _Judged(False, cpu_busy, None, False)
        gpu_busy = sum(sms) / len(sms) >= GPU_BUSY_PERCENT
        whole = len(sms) == len(recent)
        spinning = (
            whole
            and min(sms) >= SPIN_SM_PERCENT
            and all(mem is not None and mem == 0 for _, _, _, mem in recent)
        )
        if not spinning:
            rank.spin_since = None
        elif rank.spin_since is None:
            rank.spin_since = at
        return _Judged(False, cpu_busy, gpu_busy, whole and max(sms) == 0)

    def _judge(self, job: JobSample, state: _Job, now: float) -> JobSample:
        seen = {r.key.pid for r in job.ranks}
        for pid in [p for p in state.ranks if p not in seen]:
            del state.ranks[pid]
        judged = {r.key.pid: self._window(r, state, now) for r in job.ranks}
        silent = [r.rank_label for r in job.ranks if judged[r.key.pid].gpu_silent]
        stuck = self._probe_flight(job, state, judged, now)
        ranks = []
        reasons: dict[str, str] = {}
        working: list[str] = []
        for r in job.ranks:
            j = judged[r.key.pid]
            rank = state.ranks[r.key.pid]
            reason = None
            if not j.fresh:
                if j.gpu_busy and silent:
                    reason = "waiting"
                elif not j.cpu_busy and not j.gpu_busy:
                    reason = "idle"
                elif stuck is not None and r.rank_label in state.fr_pending:
                    reason = "collective"
                    rank.last_progress = min(rank.last_progress, stuck)
            if reason is None:
                rank.last_progress = now
                working.append(r.rank_label)
            else:
                reasons[r.rank_label] = reason
            ranks.append(
                evolve(
                    r,
                    progress=RankProgress(
                        round(now - rank.last_progress, 3),
                        reason,
                        j.cpu_busy,
                        j.gpu_busy,
                        round(now - rank.spin_since, 3) if rank.spin_since is not None else 0.0,
                    ),
                )
            )
        stalled = max((now - state.ranks[r.key.pid].last_progress for r in job.ranks), default=0.0)
        if "waiting" in reasons.values():
            suspects = tuple(silent)
        elif "collective" in reasons.values():
            suspects = tuple(sorted(state.fr_behind))
        elif reasons and working:
            suspects = tuple(working)
        else:
            suspects = ()
        out = evolve(job, ranks=tuple(ranks), stalled_seconds=round(stalled, 3), suspected_missing=suspects)
        if stalled < self.threshold:
            if state.reported:
                log.info("job %s: making progress again", job.key)
                with self._lock:
                    if state.snapshot is not None:
                        state.snapshot = state.snapshot.ended(self.wall())
            state.reported = False
        elif not state.reported:
            state.reported = True
            state.episode += 1
            self._report(out, reasons, state.episode)
        return out

    def _probe_flight(
        self, job: JobSample, state: _Job, judged: dict[int, _Judged], now: float
    ) -> float | None:
        """While every rank's GPU is busy (a spinning collective looks so, and so does work) and
        the job set its flight recorder's FIFO, ask it
        (on a thread of its own) every PROBE_EVERY_S; return since when no collective has
        completed while some were pending (None: progress, or nothing to go by)."""
        busy = bool(job.ranks) and all(j.gpu_busy and not j.fresh for j in judged.values())
        piped = [r for r in job.ranks if r.flight_pipe and r.rank is not None and r.flight_recorder]
        with self._lock:
            if not busy or not piped:
                state.probe_last, state.fr_stuck_since = None, None
                state.fr_pending, state.fr_behind = frozenset(), frozenset()
                return None
            if not state.probing and now >= state.probe_next:
                state.probing = True
                state.probe_next = now + max(PROBE_EVERY_S, self.threshold / 3)
                threading.Thread(
                    target=self._probe, args=(job.key, piped, now), name="trainwatch-fr-probe", daemon=True
                ).start()
            return state.fr_stuck_since

    def _probe(self, key: str, ranks: list[RankSample], at: float) -> None:
        """One flight-recorder probe: ask every rank for a dump, compare with the last one. The
        job is marked not probing only once its state holds the answer."""
        status: dict[tuple[int, str], tuple[int, int]] = {}
        try:
            with self._fr_lock(key):
                requested = self.wall()
                _note, pending = request_flight(self.proc_root, ranks)
                dumps, _missing = collect_dumps(pending, requested, self._seen(key))
            status = {(d.rank, pg): (enq, done) for d in dumps for pg, (enq, _s, done) in d.status.items()}
            labels = {r.rank: r.rank_label for r in ranks}
            verdict = summarise(dumps, ())
            with self._lock:
                state = self._jobs.get(key)
                if state is not None and status:
                    self._compare(state, status, labels, verdict.laggards if verdict else (), at)
        finally:
            with self._lock:
                state = self._jobs.get(key)
                if state is not None:
                    state.probing = False

    @staticmethod
    def _compare(
        state: _Job,
        status: dict[tuple[int, str], tuple[int, int]],
        labels: dict[int | None, str],
        laggards: tuple[int, ...],
        at: float,
    ) -> None:
        """Under the lock: a probe's answer against the previous one."""
        prev, prev_at = state.probe_last, state.probe_last_at
        pending_ranks = {rank for (rank, _pg), (enq, done) in status.items() if enq > done}
        if prev is not None:
            advanced = any(status[k][1] > v[1] for k, v in prev.items() if k in status)
            if advanced or not pending_ranks:
                state.fr_stuck_since = None
            elif state.fr_stuck_since is None:
                state.fr_stuck_since = prev_at
        state.fr_pending = frozenset(labels.get(r, str(r)) for r in pending_ranks)
        state.fr_behind = frozenset(labels.get(r, str(r)) for r in laggards)
        state.probe_last, state.probe_last_at = status, at

    def _report(self, job: JobSample, reasons: dict[str, str], episode: int) -> None:
        by_reason: dict[str, list[str]] = {}
        for label, reason in reasons.items():
            by_reason.setdefault(reason, []).append(label)
        log.warning(
            "job %s: stalled for %.0f s: %s%s",
            job.key,
            job.stalled_seconds,
            "; ".join(f"rank(s) {', '.join(labels)} {REASONS[why]}" for why, labels in by_reason.items()),
            f"; they wait for rank(s) {', '.join(job.suspected_missing)}" if job.suspected_missing else "",
        )
        threading.Thread(
            target=self._snapshot,
            args=(job, self.wall(), episode),
            name="trainwatch-stall-snapshot",
            daemon=True,
        ).start()

    def stall(self, job: str) -> StallSnapshot | None:
        """The snapshot of the job's stall (the postmortem's ``stall``): while it lasts, and
        for ``ENDED_KEPT_S`` after it ended (a rank's own exit at a timeout uses CPU: the
        stall seems to end as the job dies); None otherwise."""
        with self._lock:
            state = self._jobs.get(job)
            snap = state.snapshot if state else None
        ended = snap.ended_at if snap else None
        if ended is not None and self.wall() - ended > ENDED_KEPT_S:
            return None
        return snap

    # -- the snapshot's thread (stacks.py does its reads) ----------------------------------

    def _snapshot(self, job: JobSample, at: float, episode: int) -> None:
        """Stacks, the flight recorder and the activity of every rank of a stalled job."""
        fr_lock = self._fr_lock(job.key)
        fr_lock.acquire()  # one request at a time: a probe's and this one's dumps are one file
        try:
            requested = self.wall()
            flight_note, pending = request_flight(self.proc_root, job.ranks)
            ranks = rank_stacks(job, self.py_spy, self.no_stacks)
            flight_lines, flight_laggards = read_flight(pending, requested, self._seen(job.key))
        finally:
            fr_lock.release()
        taken = snapshot_of(job, at, ranks, flight_note, flight_lines, flight_laggards)
        with self._lock:
            state = self._jobs.get(job.key)
            if state is not None and state.episode == episode and state.reported:
                state.snapshot = taken

    def _fr_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._fr_locks.setdefault(key, threading.Lock())

    def _seen(self, key: str) -> dict[int, float]:
        with self._lock:
            state = self._jobs.get(key)
            return state.dumps_seen if state is not None else {}
