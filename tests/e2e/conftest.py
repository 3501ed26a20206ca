"""The end-to-end tests: every test here starts real jobs and produces real deaths, so every
one is marked ``slow`` here, once, rather than file by file (``-m "not slow"`` is the fast
suite: tests/unit/)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test collected below this folder (the hook sees the whole
    session's items, wherever their files are)."""
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)
