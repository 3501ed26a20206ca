"""Units on the ground floor: sizes as the documents and logs print them, and Go's
durations (the exporter-toolkit's web config, Prometheus's API). Pure, imports nothing of
the package."""

from __future__ import annotations

import re

__all__ = ["GIB", "MIB", "format_bytes", "gib", "gib_or_mib", "go_duration"]

MIB = 1 << 20
GIB = 1 << 30

_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


def go_duration(text: str) -> float | None:
    """Seconds of a Go duration (``2ms``, ``1m30s``, ``0s``); None when it is not one."""
    parts = _GO_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        return None
    return sum(float(n) * _GO_UNITS[u] for n, u in parts)


def gib(n: float, digits: int = 1) -> str:
    """``n`` bytes in GiB: ``3.0 GiB``."""
    return f"{n / GIB:.{digits}f} GiB"


def gib_or_mib(n: float, digits: int = 1) -> str:
    """GiB (``digits`` after the point) from 1 GiB up, whole MiB below: ``1.5 GiB``,
    ``52 MiB`` (a rate or a growth, which may be negative, by its size)."""
    return gib(n, digits) if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


def format_bytes(n: float) -> str:
    """The largest binary unit ``n`` reaches, one decimal: ``1.5 GiB``, ``12.0 KiB``, ``512 B``."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
