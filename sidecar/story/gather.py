"""What ``trainwatch story`` reads before it joins: from Prometheus, the job's deaths and
ranks on every node (each series' ``instance``), the nodes' scrape addresses and health,
and each node's clock against Prometheus's; from each node's daemon, the job's
postmortems. Nothing here judges; ``join.py`` does, from this record alone (so the record
of a real run can be joined again in a test or a benchmark)."""

from __future__ import annotations

import re
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sidecar.postmortem import ID_PATTERN, SCHEMA
from sidecar.story.clock import Offset, from_rounds, from_stamps
from sidecar.story.fetch import ClientConfig, FetchError, get_json
from sidecar.story.prom import PromError, Prometheus, quote

__all__ = ["MetricDeath", "NoDeath", "NodeSeen", "RankSeen", "Seen", "gather"]

LISTING_LIMIT = 1 << 20  # a node's list of one job's postmortems
DOCUMENT_LIMIT = 8 << 20  # one postmortem (a long timeline is a few hundred KiB)
DOCUMENTS_PER_NODE = 16  # the newest of one job on one node (one per attempt that died)
CLOCK_MARGIN_S = 120.0  # scrapes this long around the deaths bound the clocks
NODE_WORKERS = 32


class NoDeath(Exception):
    """Prometheus holds no death of that job (or of any job) in the window."""


@dataclass(frozen=True, slots=True)
class MetricDeath:
    instance: str
    rank: str  # the rank label (a number, or a pid-named label when the rank is unknown)
    restart: int
    killer: str
    at: float  # the node's clock


@dataclass(frozen=True, slots=True)
class RankSeen:
    instance: str
    rank: str
    local_rank: str
    pid: str
    restart: int


@dataclass(slots=True)
class NodeSeen:
    instance: str
    url: str | None = None  # its daemon's base URL (the scrape URL without /metrics)
    health: str | None = None  # Prometheus's last scrape: up, down, unknown; None: not a target now
    last_error: str = ""
    last_round: float | None = None  # node clock of the last sampling round Prometheus kept
    docs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # why its postmortems could not be read
    dropped: list[str] = field(default_factory=list)  # what it served that is not a postmortem of the job
    offset: Offset = field(default_factory=lambda: Offset(None, None, 0, "none"))


@dataclass(slots=True)
class Seen:
    """What one story asked of Prometheus and the nodes, and what it found: the job, the
    window, when, and each node's answer."""

    job: str
    window_seconds: float
    asked_at: float
    prometheus: str
    deaths: list[MetricDeath]
    ranks: list[RankSeen]
    nodes: dict[str, NodeSeen]

    def as_dict(self) -> dict[str, Any]:
        """The record, as JSON (fixtures and the scale benchmark replay it)."""
        return {
            "job": self.job,
            "window_seconds": self.window_seconds,
            "asked_at": self.asked_at,
            "prometheus": self.prometheus,
            "deaths": [vars_of(d) for d in self.deaths],
            "ranks": [vars_of(r) for r in self.ranks],
            "nodes": {
                k: {
                    **{f: getattr(n, f) for f in NodeSeen.__slots__ if f != "offset"},
                    "offset": vars_of(n.offset),
                }
                for k, n in self.nodes.items()
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Seen:
        """The record ``as_dict`` wrote (a recorded run, joined again)."""
        nodes = {}
        for k, n in d["nodes"].items():
            fields = {f: n[f] for f in NodeSeen.__slots__ if f != "offset" and f in n}
            nodes[k] = NodeSeen(**{**fields, "offset": Offset(**n["offset"])})
        return cls(
            d["job"],
            d["window_seconds"],
            d["asked_at"],
            d["prometheus"],
            [MetricDeath(**x) for x in d["deaths"]],
            [RankSeen(**x) for x in d["ranks"]],
            nodes,
        )


def vars_of(obj: Any) -> dict[str, Any]:
    return {f: getattr(obj, f) for f in obj.__slots__}


def _int(text: str, default: int = 0) -> int:
    return int(text) if text.isdigit() and len(text) < 10 else default


def _instances_regex(instances: list[str]) -> str:
    return quote("|".join(re.escape(i) for i in sorted(instances)))


def newest_job(prom: Prometheus, window: float) -> str:
    """The job whose newest death is the newest of all."""
    series = prom.query(
        f"max by (job) (last_over_time(trainwatch_rank_death_timestamp_seconds[{window:.0f}s]))"
    )
    best = max(((s.last[1], s.labels.get("job", "")) for s in series if s.labels.get("job")), default=None)
    if best is None:
        raise NoDeath(f"Prometheus holds no trainwatch rank death in the last {window:.0f} s")
    return best[1]


def gather(
    prom: Prometheus,
    job: str | None,
    *,
    window: float = 86400.0,
    nodes_config: ClientConfig | None = None,
    timeout: float = 3.0,
) -> Seen:
    """Ask Prometheus, then every node of the job. PromError when Prometheus cannot be
    asked; NoDeath when the job has no death; a node that cannot be read is recorded, not raised."""
    asked_at = time.time()
    if job is None:
        job = newest_job(prom, window)
    q = quote(job)
    deaths = [
        MetricDeath(
            s.labels.get("instance", ""),
            s.labels.get("rank", ""),
            _int(s.labels.get("restart", "0")),
            s.labels.get("killer", "unknown"),
            s.last[1],
        )
        for s in prom.query(
            f"last_over_time(trainwatch_rank_death_timestamp_seconds{{job={q}}}[{window:.0f}s])"
        )
    ]
    if not deaths:
        raise NoDeath(f"Prometheus holds no death of job {job!r} in the last {window:.0f} s")
    ranks = [
        RankSeen(
            s.labels.get("instance", ""),
            s.labels.get("rank", ""),
            s.labels.get("local_rank", ""),
            s.labels.get("pid", ""),
            _int(s.labels.get("restart", "0")),
        )
        for s in prom.query(f"last_over_time(trainwatch_rank_info{{job={q}}}[{window:.0f}s])")
    ]
    instances = sorted({d.instance for d in deaths} | {r.instance for r in ranks})
    nodes = {i: NodeSeen(i) for i in instances}
    targets = prom.targets()
    for i, node in nodes.items():
        t = targets.get(i)
        if t is not None:
            node.health, node.last_error = t.health, t.last_error
            node.url = _base(t.scrape_url)
        else:
            node.url = f"http://{i}" if re.fullmatch(r"[A-Za-z0-9_.\-\[\]:]{1,255}", i) else None
    regex = _instances_regex(instances)
    for s in prom.query(
        f"last_over_time(trainwatch_last_sample_timestamp_seconds{{instance=~{regex}}}[{window:.0f}s])"
    ):
        n = nodes.get(s.labels.get("instance", ""))
        if n is not None:
            n.last_round = s.last[1]
    _clocks(prom, nodes, regex, min(d.at for d in deaths), max(d.at for d in deaths), asked_at)
    with ThreadPoolExecutor(max_workers=max(1, min(NODE_WORKERS, len(nodes)))) as pool:
        list(pool.map(lambda n: _read_node(n, job, nodes_config, timeout), nodes.values()))
    return Seen(job, window, asked_at, prom.url, deaths, ranks, nodes)


def _base(scrape_url: str) -> str | None:
    parts = urllib.parse.urlsplit(scrape_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    path = parts.path[: -len("/metrics")] if parts.path.endswith("/metrics") else ""
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _clocks(
    prom: Prometheus, nodes: dict[str, NodeSeen], regex: str, first: float, last: float, now: float
) -> None:
    """Each node's offset from the scrapes around the deaths (the deaths' node times are
    within seconds of Prometheus's, or the offsets say how far they are not)."""
    end = min(now, last + CLOCK_MARGIN_S)
    span = max(end - (first - CLOCK_MARGIN_S), 1.0)
    rng = f"[{span:.0f}s]"

    def raw(name: str) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for s in prom.query(f"{name}{{instance=~{regex}}}{rng}", at=end):
            out.setdefault(s.labels.get("instance", ""), []).extend(s.samples)
        return out

    tolerance = prom.timestamp_tolerance()
    durations = {i: dict(v) for i, v in raw("scrape_duration_seconds").items()}
    stamps = raw("trainwatch_time_seconds")
    rounds = raw("trainwatch_last_sample_timestamp_seconds")
    for i, node in nodes.items():
        d = durations.get(i, {})
        if stamps.get(i):
            node.offset = from_stamps(stamps[i], d, tolerance)
        elif rounds.get(i):
            node.offset = from_rounds(rounds[i], d, tolerance)


def _read_node(node: NodeSeen, job: str, config: ClientConfig | None, timeout: float) -> None:
    """The node's postmortems of ``job``, newest first; the node's error when it cannot be read."""
    base = node.url
    if base is None:
        node.error = "no address to reach its daemon"
        return
    deadline = time.monotonic() + 2 * timeout

    def get(path: str, limit: int) -> Any:
        left = deadline - time.monotonic()
        if left <= 0:
            raise FetchError(f"{base}: no complete answer within {2 * timeout:g} s")
        return get_json(base + path, timeout=min(timeout, left), limit=limit, config=config)

    try:
        listing = get(f"/postmortems?{urllib.parse.urlencode({'job': job})}", LISTING_LIMIT)
        if not isinstance(listing, list):
            raise FetchError(f"{base}/postmortems: not a list of postmortems")
        ids = []
        for entry in listing:
            ident = entry.get("id") if isinstance(entry, dict) else None
            if not isinstance(ident, str) or not ID_PATTERN.match(ident):
                node.dropped.append("an entry of /postmortems without a valid id")
                continue
            if entry.get("job") not in (None, job):  # an older daemon ignores ?job=
                continue
            ids.append(ident)
        for ident in ids[:DOCUMENTS_PER_NODE]:
            doc = get(f"/postmortems/{ident}?view=summary", DOCUMENT_LIMIT)  # without its timeline
            if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
                node.dropped.append(f"{ident}: not a {SCHEMA} document")
            elif not isinstance(doc.get("job"), dict) or doc["job"].get("key") != job:
                continue
            else:
                node.docs.append(doc)
    except FetchError as exc:
        node.error = str(exc)


__all__ += ["PromError", "newest_job"]
