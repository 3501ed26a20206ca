"""How the families are written as the collector fills them: prometheus_client's family
objects (``Families``, for ``collect``), or the exposition's text straight (``Lines``,
byte for byte the same, for a scrape), and the per-scrape clock appended to a cached body
(``with_clock``)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sidecar.metrics.exposition import escape_help, escape_value, number
from sidecar.metrics.table import METRICS

__all__ = ["Families", "Lines", "with_clock"]


class Families:
    """prometheus_client's family objects, each made as its first sample is added."""

    def __init__(self) -> None:
        self.families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(self, name: str, value: float, *labels: str) -> None:
        family = self.families.get(name)
        if family is None:
            spec = METRICS[name]
            if spec.kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), spec.help, labels=spec.labels)
            else:
                family = GaugeMetricFamily(name, spec.help, labels=spec.labels)
            self.families[name] = family
        family.add_metric(list(labels), value)


class Lines:
    """The exposition written as the families are filled: byte for byte what
    ``exposition.render(collect())`` gives, without building prometheus_client's family
    and sample objects (most of a scrape's time at 64 ranks)."""

    def __init__(self, openmetrics: bool) -> None:
        self.openmetrics = openmetrics
        self.families: dict[str, list[str]] = {}

    def add(self, name: str, value: float, *labels: str) -> None:
        lines = self.families.get(name)
        spec = METRICS[name]
        if lines is None:
            header = name.removesuffix("_total") if spec.kind == "counter" and self.openmetrics else name
            lines = self.families[name] = [
                f"# HELP {header} {escape_help(spec.help, self.openmetrics)}\n",
                f"# TYPE {header} {spec.kind}\n",
            ]
        if labels:
            inner = ",".join(f'{k}="{escape_value(v)}"' for k, v in zip(spec.labels, labels, strict=False))
            lines.append(f"{name}{{{inner}}} {number(value)}\n")
        else:
            lines.append(f"{name} {number(value)}\n")

    def body(self) -> bytes:
        text = "".join(line for lines in self.families.values() for line in lines)
        return (text + "# EOF\n" if self.openmetrics else text).encode()


def with_clock(body: bytes, openmetrics: bool, now: float) -> bytes:
    """``body`` with ``trainwatch_time_seconds`` at ``now`` appended (before OpenMetrics'
    ``# EOF``): written per scrape, outside the cache of rendered bodies."""
    lines = Lines(openmetrics)
    lines.add("trainwatch_time_seconds", now)
    clock = "".join(lines.families["trainwatch_time_seconds"]).encode()
    if openmetrics and body.endswith(b"# EOF\n"):
        return body[: -len(b"# EOF\n")] + clock + b"# EOF\n"
    return body + clock
