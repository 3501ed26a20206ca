"""torchrun's own text, as torch 2.4+'s elastic agent writes it, for tests that diagnose
pastes: the failure table of ``ChildFailedError`` (torch/distributed/elastic/multiprocessing/
errors/__init__.py ``ChildFailedError.format_msg``: the other failures, then the root cause)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Failure", "failure_table"]

_RULE = "=" * 60
_THIN = "-" * 60


@dataclass(frozen=True)
class Failure:
    rank: int
    local_rank: int
    exitcode: int
    pid: int
    time: str  # as the table prints it: 2024-12-09_06:53:34
    traceback: str
    host: str = "node-3"


def _entry(i: int, f: Failure) -> str:
    return (
        f"[{i}]:\n  time      : {f.time}\n  host      : {f.host}\n"
        f"  rank      : {f.rank} (local_rank: {f.local_rank})\n  exitcode  : {f.exitcode} (pid: {f.pid})\n"
        f"  error_file: <N/A>\n  traceback : {f.traceback}\n"
    )


def failure_table(root: Failure, *others: Failure, script: str = "train.py") -> str:
    """The table as the agent prints it: the others first (or <NO_OTHER_FAILURES>), then the
    root cause ("first observed failure")."""
    failures = "".join(_entry(i + 1, f) for i, f in enumerate(others)) or "  <NO_OTHER_FAILURES>\n"
    return (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        f"{_RULE}\n{script} FAILED\n{_THIN}\nFailures:\n{failures}{_THIN}\n"
        f"Root Cause (first observed failure):\n{_entry(0, root)}{_RULE}\n"
    )
