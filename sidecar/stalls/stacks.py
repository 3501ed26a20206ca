"""A stalled job's snapshot, taken on a thread of its own (never the sampler's): each rank's
Python stack with ``py-spy dump --nonblocking`` (reads the rank's memory without pausing
it), a flight-recorder dump asked through the job's own FIFO (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``)
and read back through the safe-read helper, and the snapshot document the postmortem
carries as ``stall``. The judging itself is ``tracker.py``'s.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import time

from sidecar import lognames
from sidecar.model import JobSample, RankSample
from sidecar.model.stall import StalledRank, StallSnapshot
from sidecar.parse.flight import MAX_DUMP_BYTES, FlightDump, parse_dump, summarise
from sidecar.probes.host import ptrace_scope
from sidecar.saferead import JobRoot, Refused, poke_job_fifo, read_job_file

__all__ = [
    "collect_dumps",
    "in_collective",
    "py_spy_status",
    "rank_stacks",
    "read_flight",
    "request_flight",
    "snapshot_of",
]

log = logging.getLogger(lognames.STALLS)

PY_SPY_TIMEOUT_S = 20.0
STACK_CAP = 20000
FLIGHT_WAIT_S = 15.0  # how long the snapshot waits for the dumps it asked for
# a frame of torch.distributed's collectives (c10d) in a py-spy dump: the rank waits in one
COLLECTIVE_FRAMES = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py")


def in_collective(stack: str) -> bool:
    """Whether a py-spy dump shows the thread inside a torch.distributed collective."""
    return any(frame in stack for frame in COLLECTIVE_FRAMES)


def py_spy_status(wanted: bool | None, proc_root: str = "/proc") -> tuple[str | None, str | None]:
    """(py-spy's path, None) when stacks will be taken, else (None, why not). ``wanted``:
    True (asked for), False (turned off), None (on where installed and permitted)."""
    if wanted is False:
        return None, "turned off (--no-py-spy)"
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # the same venv's
    found = shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)
    if found is None:
        return None, "py-spy is not installed (pip install py-spy)"
    scope = ptrace_scope(proc_root)
    if scope >= 3:
        return None, "ptrace is disabled on this machine (kernel.yama.ptrace_scope=3)"
    if os.geteuid() != 0 and scope >= 1:
        return None, f"not root and kernel.yama.ptrace_scope={scope}: py-spy may not attach"
    return found, None


def _stack(py_spy: str, pid: int) -> tuple[str | None, str | None]:
    try:
        done = subprocess.run(
            [py_spy, "dump", "--nonblocking", "--pid", str(pid)],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=PY_SPY_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"py-spy failed: {exc}"
    if done.returncode != 0:
        return None, f"py-spy failed: {done.stderr.strip()[:500]}"
    return done.stdout[-STACK_CAP:], None


def rank_stacks(job: JobSample, py_spy: str | None, no_stacks: str | None) -> list[StalledRank]:
    """Each rank's stack (or why none) and activity, as the snapshot's ``ranks``."""
    ranks = []
    for r in job.ranks:
        stack, error = _stack(py_spy, r.key.pid) if py_spy else (None, no_stacks)
        p = r.progress
        ranks.append(
            StalledRank(
                rank=r.rank,
                label=r.rank_label,
                pid=r.key.pid,
                stalled_seconds=p.stalled_seconds if p else None,
                reason=p.reason if p else None,
                cpu_busy=p.cpu_busy if p else None,
                gpu_busy=p.gpu_busy if p else None,
                gpu_sm_percent=r.gpu_sm_percent,
                gpu_memory_percent=r.gpu_memory_percent,
                stack=stack,
                stack_error=error,
                in_collective=in_collective(stack) if stack else None,
            )
        )
        if stack:
            log.warning(
                "job %s: rank %s (pid %d) Python stack while stalled:\n%s",
                job.key,
                r.rank_label,
                r.key.pid,
                stack.rstrip(),
            )
    return ranks


def snapshot_of(
    job: JobSample,
    at: float,
    ranks: list[StalledRank],
    flight_note: str | None,
    flight_lines: list[str],
    flight_laggards: tuple[int, ...],
) -> StallSnapshot:
    """The stall's snapshot: who is suspected, and by what (activity, stacks, the flight
    recorder, the strongest last)."""
    suspects = [str(s) for s in job.suspected_missing]
    how = "activity" if suspects else None
    inside = {r.label for r in ranks if r.in_collective}
    outside = {r.label for r in ranks if r.in_collective is False}
    if inside and outside:
        suspects, how = sorted(outside), "stacks"  # the others wait in a collective for them
    if flight_laggards:
        suspects, how = [str(r) for r in flight_laggards], "flight_recorder"
    return StallSnapshot(
        detected_at=at,
        stalled_seconds=job.stalled_seconds,
        ranks=tuple(ranks),
        suspected_missing=tuple(suspects),
        suspected_by=how,
        flight_recorder="; ".join([flight_note, *flight_lines]) if flight_note else None,
    )


def request_flight(
    proc_root: str, ranks: tuple[RankSample, ...] | list[RankSample]
) -> tuple[str | None, list[tuple[RankSample, JobRoot]]]:
    """Write into each rank's dump FIFO where the job set one; what was asked, and the
    ranks whose dumps to wait for (with their roots, taken while they live)."""
    asked: list[str] = []
    refused: list[str] = []
    pending: list[tuple[RankSample, JobRoot]] = []
    for r in ranks:
        if not r.flight_pipe or r.rank is None or r.flight_recorder is None:
            continue
        path = f"{r.flight_pipe}{r.rank}.pipe"
        try:
            root = JobRoot(proc_root, r.key.pid)
        except OSError as exc:
            refused.append(f"rank {r.rank_label}: {exc.strerror}")
            continue
        try:
            poke_job_fifo(root, path, owner=r.uid)
        except (Refused, OSError, TimeoutError) as exc:
            root.close()
            why = "no such FIFO" if getattr(exc, "errno", None) == errno.ENOENT else str(exc)
            refused.append(f"rank {r.rank_label}: {path!r} not written ({why})")
            continue
        asked.append(f"rank {r.rank_label} through {path!r}")
        pending.append((r, root))
    if not asked and not refused:
        return None, []
    note = f"dump requested from {', '.join(asked)}" if asked else "no dump requested"
    return "; ".join([note, *refused]), pending


def read_flight(
    pending: list[tuple[RankSample, JobRoot]], requested: float, seen: dict[int, float]
) -> tuple[list[str], tuple[int, ...]]:
    """Wait (bounded) for the dumps asked for, newer than the request; summarise them."""
    dumps, missing = collect_dumps(pending, requested, seen)
    verdict = summarise(dumps, ())
    lines = [*(verdict.lines if verdict else ()), *missing]
    if dumps and verdict is None:
        lines.append("flight recorder: no collective pending on any rank that dumped")
    return lines, verdict.laggards if verdict else ()


def collect_dumps(
    pending: list[tuple[RankSample, JobRoot]], requested: float, seen: dict[int, float]
) -> tuple[list[FlightDump], list[str]]:
    """The dumps asked for, once written after the request (and after the last one read of
    that rank, ``seen``, which is updated), waiting at most FLIGHT_WAIT_S of real time;
    and why any is missing. Closes the roots."""
    dumps: list[FlightDump] = []
    missing: list[str] = []
    deadline = time.monotonic() + FLIGHT_WAIT_S
    try:
        waiting = list(pending)
        while waiting:
            for item in list(waiting):
                r, root = item
                assert r.flight_recorder is not None and r.rank is not None
                path = f"{r.flight_recorder[1]}{r.rank}"
                try:
                    got = read_job_file(root, path, owner=r.uid, cap=MAX_DUMP_BYTES)
                except (OSError, Refused, TimeoutError):
                    continue
                if got.mtime < requested - 1.0 or got.mtime <= seen.get(r.rank, 0.0):
                    continue  # an older dump: not the one asked for yet
                seen[r.rank] = got.mtime
                waiting.remove(item)
                try:
                    dumps.append(parse_dump(got.data, r.rank, path))
                except ValueError as exc:
                    missing.append(str(exc))
            if waiting and time.monotonic() >= deadline:
                missing.extend(
                    f"rank {r.rank_label}: no dump at {(r.flight_recorder or (0, '?'))[1]}{r.rank}"
                    f" within {FLIGHT_WAIT_S:.0f} s"
                    for r, _ in waiting
                )
                break
            if waiting:
                time.sleep(0.25)  # polling a file the rank is writing, bounded by the deadline
    finally:
        for _, root in pending:
            root.close()
    return dumps, missing
