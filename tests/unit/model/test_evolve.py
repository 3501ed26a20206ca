"""The records' evolve(): what dataclasses.replace gives, without re-running __init__."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.model import CgroupLevel, CgroupSample, evolve


def test_evolve_is_replace():
    cg = CgroupSample(
        path="/a",
        version=1,
        usage_bytes=1,
        limit_bytes=2,
        peak_bytes=3,
        oom_kills=0,
        oom_events=None,
        ancestors=(CgroupLevel("/", None),),
        limited_by="/a",
        effective_limit_bytes=2,
    )
    assert evolve(cg, usage_bytes=5) == dataclasses.replace(cg, usage_bytes=5)
    assert evolve(cg) == cg and evolve(cg) is not cg
    with pytest.raises(TypeError, match="no field"):
        evolve(cg, usage=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolve(cg, usage_bytes=6).usage_bytes = 7  # type: ignore[misc]
