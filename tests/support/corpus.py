"""The public corpus (tests/fixtures/public-logs/cases.jsonl) and its fixed split.

A thread's half is decided by a hash of its URL, fixed before any rule is written against
the cases: ``dev`` cases may be read while writing rules, ``held_out`` cases are only
scored (benchmarks/diagnose_accuracy.py; the catalog's real examples never come from a
held-out thread, tests/unit/catalog/test_entries.py checks it). Every case of one thread is
in one half.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tests.support.paths import PUBLIC_CASES

__all__ = ["HALVES", "cases", "half"]

HALVES = ("dev", "held_out")


def half(url: str) -> str:
    """``dev`` or ``held_out``: the first byte of the SHA-256 of the URL (its fragment and a
    trailing slash removed), even or odd."""
    u = url.strip().split("#")[0].rstrip("/")
    return HALVES[hashlib.sha256(u.encode()).digest()[0] % 2]


def cases(which: str | None = None) -> list[dict[str, Any]]:
    """The corpus's cases, or one half's."""
    every = [json.loads(line) for line in PUBLIC_CASES.read_text().splitlines() if line.strip()]
    return [c for c in every if which is None or half(c["source"]) == which]
