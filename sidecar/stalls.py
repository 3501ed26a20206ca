"""Stalls before the timeout: a job whose every rank stopped making progress.

Users should not wait the 10-30 minutes of a collective timeout to learn that a job hung.
A rank makes progress while its CPU time grows faster than ``IDLE_CORE_FRACTION`` of a
core; a job is stalled for as long as none of its live ranks does (``stalled_seconds``,
0 while any rank works). A rank blocked in a gloo collective, a sleep or a lock uses no
CPU. The limit of this signal: a rank waiting in ``cudaStreamSynchronize`` may spin a core
at 100 %, and a spinning NCCL kernel keeps its GPU busy, so an NCCL hang can look busy
here; the flight recorder and the watchdog are the evidence there.

With ``--py-spy`` and py-spy installed, the first time a job is stalled past the
threshold each rank's Python stack is recorded (``py-spy dump``, in a thread of its own,
never on the sampler's), logged, shown in /ranks and put into the job's next postmortem.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.model import Snapshot

__all__ = ["IDLE_CORE_FRACTION", "StallTracker"]

log = logging.getLogger(__name__)

IDLE_CORE_FRACTION = 0.05
# CPU time moves in 10 ms ticks and ranks keep background threads (gloo, the store's
# keep-alive): judge the rate over a window of a few seconds, not over one round.
WINDOW_SECONDS = (2.0, 10.0)
PY_SPY_TIMEOUT_S = 20.0


@dataclass
class _Job:
    last_progress: float
    cpu: dict[int, collections.deque[tuple[float, float]]] = field(default_factory=dict)  # pid -> (at, cpu s)
    reported: bool = False
    stacks: dict[str, str] = field(default_factory=dict)  # rank label -> py-spy dump
    stacks_at: float | None = None


class StallTracker:
    def __init__(
        self,
        threshold_seconds: float,
        *,
        py_spy: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.threshold = threshold_seconds
        self.clock = clock
        self.wall = wall
        self.window = max(WINDOW_SECONDS[0], min(WINDOW_SECONDS[1], threshold_seconds / 2))
        beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # the same venv's
        found = shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)
        self.py_spy = found if py_spy else None
        if py_spy and self.py_spy is None:
            log.warning("stalls: --py-spy given but py-spy is not installed (pip install py-spy): no stacks")
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def update(self, snap: Snapshot) -> dict[str, float]:
        """Sampler thread: job key -> seconds every rank has been idle (0: progressing)."""
        now = self.clock()
        out: dict[str, float] = {}
        live = set()
        for job in snap.jobs:
            live.add(job.key)
            with self._lock:
                state = self._jobs.setdefault(job.key, _Job(now))
            busy = not job.ranks
            seen = set()
            for r in job.ranks:
                seen.add(r.key.pid)
                history = state.cpu.setdefault(r.key.pid, collections.deque())
                history.append((now, r.cpu_seconds))
                while len(history) > 2 and history[1][0] <= now - self.window:
                    history.popleft()
                at, cpu = history[0]
                if now - at < self.window:
                    busy = True  # too new to judge (a start, a restart): progress by definition
                elif (r.cpu_seconds - cpu) / (now - at) > IDLE_CORE_FRACTION:
                    busy = True
            for pid in [p for p in state.cpu if p not in seen]:
                del state.cpu[pid]
            if busy:
                state.last_progress = now
                if state.reported:
                    log.info("job %s: making progress again", job.key)
                state.reported = False
            stalled = now - state.last_progress
            out[job.key] = stalled
            if stalled >= self.threshold and not state.reported:
                state.reported = True
                log.warning(
                    "job %s: stalled: none of its %d rank(s) used CPU for %.0f s (a hang, or a collective "
                    "waiting for a rank that never arrives)",
                    job.key,
                    len(job.ranks),
                    stalled,
                )
                if self.py_spy is not None:
                    pids = {r.rank_label: r.key.pid for r in job.ranks}
                    threading.Thread(
                        target=self._dump, args=(job.key, pids), name="trainwatch-py-spy", daemon=True
                    ).start()
        with self._lock:
            for key in [k for k in self._jobs if k not in live]:
                del self._jobs[key]
        return out

    def stacks(self, job: str) -> tuple[dict[str, str], float | None]:
        with self._lock:
            state = self._jobs.get(job)
            return (dict(state.stacks), state.stacks_at) if state else ({}, None)

    def _dump(self, job: str, pids: dict[str, int]) -> None:
        assert self.py_spy is not None
        stacks: dict[str, str] = {}
        for label, pid in pids.items():
            try:
                done = subprocess.run(
                    [self.py_spy, "dump", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=PY_SPY_TIMEOUT_S,
                )
                text = done.stdout if done.returncode == 0 else f"py-spy failed: {done.stderr.strip()[:500]}"
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"py-spy failed: {exc}"
            stacks[label] = text[-20000:]
            log.warning(
                "job %s: rank %s (pid %d) Python stack while stalled:\n%s", job, label, pid, text.rstrip()
            )
        with self._lock:
            state = self._jobs.get(job)
            if state is not None:
                state.stacks = stacks
                state.stacks_at = self.wall()
