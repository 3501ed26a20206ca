"""Robust trends of a series: the median, and the Theil-Sen slope (the median of the slopes
between every two points), which one outlier cannot move. Foresight's growth rates
(``sampling/foresight.py``) and what filled a limit (``autopsy/filled.py``) use them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["median", "theil_sen"]


def median(values: list[float]) -> float:
    """The median (sorts ``values`` in place)."""
    values.sort()
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2


def theil_sen(points: Sequence[tuple[float, float]]) -> float:
    """The median of the slopes between every two points (bytes per second)."""
    slopes = [
        (v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(points) for t2, v2 in points[i + 1 :] if t2 > t1
    ]
    return median(slopes) if slopes else 0.0
