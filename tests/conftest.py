from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
PROC_TORCHRUN = FIXTURES / "proc-torchrun"
# The capture in fixtures/proc-torchrun: a real `torchrun --standalone --nproc-per-node=2`
# job of tests/workloads/rank.py, each rank with two forked workers.
AGENT, RANK0, RANK1 = 3277, 3282, 3283
RANK0_WORKERS, RANK1_WORKERS = (3291, 3293), (3290, 3292)
SHELL, KTHREADD = 1110, 2
RUN_ID = "8d6de2d1-f2bf-4ce7-91d2-e43f34b89cbc"


@pytest.fixture
def proc_tree(tmp_path: Path) -> Path:
    """A writable copy of the captured /proc tree (tests edit it to simulate changes)."""
    dst = tmp_path / "proc"
    shutil.copytree(PROC_TORCHRUN, dst)
    return dst


def is_root() -> bool:
    return os.geteuid() == 0
