"""What the death watch's rooms share: the ranks known from the rounds, the deaths told, the
kernel's records, the files each job names, and the open incidents; all under one lock
(``cv``), whose condition wakes the worker when an incident falls due. The feeds
(``hear.py``) write it, the worker (``write.py``) and the journal (``remember.py``) read it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.deaths.incidents import Generation, Incident, Known
from sidecar.deaths.records import Records
from sidecar.model import Snapshot
from sidecar.probes.outputs import OutputFile

__all__ = ["AUTOPSY_DELAY_S", "UNKNOWN_EXIT_WAIT_S", "Watched"]

AUTOPSY_DELAY_S = 0.25
# A death whose exit status nobody could tell (no connector, no pidfd, the zombie missed)
# waits this long for the agent's log or the agent's own exit before it is judged: at a
# clean end of training every rank "vanishes" too, and that is no incident.
UNKNOWN_EXIT_WAIT_S = 3.0


@dataclass(eq=False)
class Watched:
    """What the death watch's rooms share, under one lock (``cv``, which the worker also
    waits on): the processes known as ranks, the last snapshots, the incidents open, and
    what the feeds recorded. The live state; what the journal keeps of it is
    ``saved.SavedState``."""

    clock_ns: Callable[[], int]
    cv: threading.Condition = field(default_factory=threading.Condition)
    known: dict[int, Known] = field(default_factory=dict)
    snapshots: deque[tuple[int, Snapshot]] = field(default_factory=lambda: deque(maxlen=8))
    records: Records = field(default_factory=Records)  # the kernel log's, the tracepoint's and NVML's
    rank_gpus: dict[int, frozenset[int]] = field(default_factory=dict)  # rank pid -> GPUs it ever used
    reported: dict[int, int] = field(default_factory=dict)  # pid -> ns: an exit was reported (any status)
    clean_exits: dict[int, tuple[int, str | None]] = field(default_factory=dict)  # before any incident
    agent_outputs: dict[int, list[OutputFile]] = field(default_factory=dict)  # agent pid -> its outputs
    # rank pid -> (its own output files, the wall time it was first seen)
    rank_files: dict[int, tuple[list[OutputFile], float]] = field(default_factory=dict)
    oomd_baseline: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)  # cgroup -> xattrs
    # One incident per job and worker generation: after an elastic restart the new
    # generation's deaths get a postmortem of their own.
    incidents: dict[Generation, Incident] = field(default_factory=dict)

    def latest(self) -> Snapshot | None:
        return self.snapshots[-1][1] if self.snapshots else None

    def schedule(self, inc: Incident, at_ns: int) -> None:
        """Under the lock: the incident's autopsy falls due a little after ``at_ns`` (time
        for the kernel's records to arrive), or sooner if it was due sooner."""
        due = max(at_ns, self.clock_ns()) + int(AUTOPSY_DELAY_S * 1e9)
        if inc.due_ns is None or due < inc.due_ns:
            inc.due_ns = due
        self.cv.notify()
