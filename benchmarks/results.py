"""Results files: every figure the docs quote comes from one of these.

``write(name, results)`` saves ``benchmarks/results/<name>.json`` with what makes a figure
comparable: the machine (CPU model, cores, memory), kernel, Python, date and the commit
the code was at (``+dirty`` when the tree had uncommitted changes). ``benchmarks/render.py``
turns them into the tables of docs/*.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# TRAINWATCH_RESULTS_DIR: write elsewhere (a run on the GPU machine writes under its $OUT,
# and the files are copied into benchmarks/results/ here).
RESULTS = Path(os.environ.get("TRAINWATCH_RESULTS_DIR") or REPO / "benchmarks" / "results")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    # a run on another machine whose copy of the tree has no history of its own says it
    if os.environ.get("TRAINWATCH_COMMIT"):
        return os.environ["TRAINWATCH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict[str, Any]:
    mem = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def write(name: str, results: dict[str, Any], *, machine_info: dict[str, Any] | None = None) -> Path:
    """Write ``benchmarks/results/<name>.json`` and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine_info or machine(),
        "results": results,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"written: {path}")
    return path


def read(name: str) -> dict[str, Any]:
    return dict(json.loads((RESULTS / f"{name}.json").read_text()))
