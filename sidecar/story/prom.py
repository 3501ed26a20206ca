"""Prometheus's HTTP API, as much as ``trainwatch story`` needs: instant queries (vectors
and raw samples of a range selector) and the active targets (each node's scrape address
and health). Every answer is checked against the API's shape; anything else is a
``PromError`` with one line, never a traceback or a hang."""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

from sidecar.story.fetch import ClientConfig, FetchError, get_json
from sidecar.units import go_duration

__all__ = ["PromError", "Prometheus", "Series", "Target", "quote"]


class PromError(Exception):
    """Prometheus cannot be asked, or did not answer as its API does (one line)."""


@dataclass(frozen=True, slots=True)
class Series:
    labels: dict[str, str]
    samples: tuple[tuple[float, float], ...]  # (Prometheus's timestamp, value), oldest first

    @property
    def last(self) -> tuple[float, float]:
        return self.samples[-1]


@dataclass(frozen=True, slots=True)
class Target:
    instance: str
    scrape_url: str
    health: str  # up, down, unknown
    last_error: str
    last_scrape: str | None


DEFAULT_TOLERANCE_S = 0.002  # Prometheus's default --scrape.timestamp-tolerance


def quote(value: str) -> str:
    """A PromQL string literal holding ``value`` exactly (a job key is the job's choice)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _float(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, str)):
        raise PromError(f"{what}: not a number: {str(x)[:40]!r}")
    try:
        value = float(x)
    except ValueError:
        raise PromError(f"{what}: not a number: {str(x)[:40]!r}") from None
    return value


def _labels(x: Any, what: str) -> dict[str, str]:
    if not isinstance(x, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in x.items()):
        raise PromError(f"{what}: labels are not a map of strings")
    return x


class Prometheus:
    def __init__(
        self, url: str, config: ClientConfig | None = None, timeout: float = 5.0, limit: int = 64 << 20
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise PromError(f"--prometheus {url!r}: not an http(s) URL")
        self.url = url.rstrip("/")
        self.config = config or ClientConfig()
        self.timeout = timeout
        self.limit = limit

    def _api(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = get_json(url, timeout=self.timeout, limit=self.limit, config=self.config)
        except FetchError as exc:
            text = str(exc)
            if "HTTP 400" in text or "HTTP 422" in text:  # the API's own error: a query it refused
                raise PromError(f"Prometheus refused a query: {text}") from None
            raise PromError(f"Prometheus at {self.url} cannot be asked: {text}") from None
        if not isinstance(body, dict) or body.get("status") != "success" or "data" not in body:
            raise PromError(f"Prometheus at {self.url}: {path} did not answer as the Prometheus API does")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Series]:
        """An instant query at ``at`` (now when None): a vector (one sample a series) or,
        for a range selector, every raw sample of each series."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params)
        what = f"Prometheus at {self.url}: query answer"
        if not isinstance(data, dict) or not isinstance(data.get("result"), list):
            raise PromError(f"{what} has no result list")
        kind = data.get("resultType")
        out = []
        for item in data["result"]:
            if not isinstance(item, dict):
                raise PromError(f"{what}: a result is not an object")
            labels = _labels(item.get("metric"), what)
            raw: Any
            if kind == "vector":
                raw = [item.get("value")]
            elif kind == "matrix":
                raw = item.get("values")
                if not isinstance(raw, list):
                    raise PromError(f"{what}: a series has no values")
            else:
                raise PromError(f"{what}: result type {str(kind)[:20]!r} is not a vector or a matrix")
            samples = []
            for pair in raw:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise PromError(f"{what}: a sample is not [time, value]")
                t, v = _float(pair[0], what), _float(pair[1], what)
                if math.isfinite(t) and math.isfinite(v):
                    samples.append((t, v))
            if samples:
                out.append(Series(labels, tuple(sorted(samples))))
        return out

    def timestamp_tolerance(self) -> float:
        """How far Prometheus may move a scrape's timestamp from the scrape's start to align
        it (``--scrape.timestamp-tolerance``, 2 ms unless changed; 0 with
        ``--no-scrape.adjust-timestamps``), from its own flags; 2 ms when it does not say."""
        try:
            flags = self._api("status/flags", {})
        except PromError:
            return DEFAULT_TOLERANCE_S
        if not isinstance(flags, dict):
            return DEFAULT_TOLERANCE_S
        if str(flags.get("scrape.adjust-timestamps", "true")).lower() == "false":
            return 0.0
        raw = flags.get("scrape.timestamp-tolerance")
        value = go_duration(raw) if isinstance(raw, str) else None
        return DEFAULT_TOLERANCE_S if value is None else value

    def targets(self) -> dict[str, Target]:
        """The active targets by their ``instance`` label."""
        data = self._api("targets", {"state": "active"})
        what = f"Prometheus at {self.url}: targets answer"
        if not isinstance(data, dict) or not isinstance(data.get("activeTargets"), list):
            raise PromError(f"{what} has no activeTargets list")
        out: dict[str, Target] = {}
        for t in data["activeTargets"]:
            if not isinstance(t, dict):
                continue
            labels = t.get("labels")
            url = t.get("scrapeUrl")
            if not isinstance(labels, dict) or not isinstance(url, str):
                continue
            instance = labels.get("instance")
            if not isinstance(instance, str):
                continue
            health = t.get("health")
            err = t.get("lastError")
            last = t.get("lastScrape")
            out[instance] = Target(
                instance,
                url,
                health if isinstance(health, str) else "unknown",
                err[:300] if isinstance(err, str) else "",
                last if isinstance(last, str) else None,
            )
        return out
