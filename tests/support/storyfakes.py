"""Servers for ``trainwatch story`` without a cluster: small HTTP servers, a Prometheus API
answering from a recorded run, and ``Cluster``: N nodes made from the recorded real
two-node run (tests/fixtures/story/), each node's daemon a real HTTP server on its own
port serving recorded postmortems, for the scale benchmark and the bad-node tests."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sidecar.postmortem.document import epoch_of, iso
from sidecar.story.gather import Seen

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "story"
Handler = Callable[[BaseHTTPRequestHandler], None]


def recorded(name: str) -> Seen:
    return Seen.from_dict(json.loads((FIXTURES / name).read_text()))


@contextmanager
def server(handle: Handler) -> Iterator[str]:
    """``handle`` answering GETs on a free loopback port: its base URL."""

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self) -> None:
            handle(self)

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def reply(body: bytes, status: int = 200) -> Handler:
    def handle(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return handle


def _api(data: Any) -> bytes:
    return json.dumps({"status": "success", "data": data}).encode()


def _job_of(query: str) -> str | None:
    """The job a story query names (``job="..."``), None for the newest-job query."""
    marker = 'job="'
    if marker not in query:
        return None
    return query.split(marker, 1)[1].split('"', 1)[0]


class PromAnswers:
    """The Prometheus API for ``story``'s queries: deaths, ranks, targets, last rounds and
    each node's raw clock samples, per instance, for any job name asked."""

    def __init__(self) -> None:
        self.deaths: list[tuple[str, str, int, str, float]] = []  # instance, rank, restart, killer, at
        self.ranks: list[tuple[str, str, str, str, int]] = []  # instance, rank, local, pid, restart
        self.urls: dict[str, str] = {}  # instance -> scrape URL
        self.last_round: dict[str, float] = {}
        self.clock: dict[str, list[tuple[float, float, float]]] = {}  # instance -> (t, v, duration)
        self.now = 0.0

    @classmethod
    def from_seen(cls, seen: Seen, where: dict[str, str]) -> PromAnswers:
        """A recorded run's answers, each node moved to its new base URL (``where``: old
        instance -> URL); no clock samples (the story then says the clocks are not bounded)."""
        prom = cls()
        moved = {old: url.split("://", 1)[1] for old, url in where.items()}
        prom.now = seen.asked_at
        prom.urls = {moved[old]: url + "/metrics" for old, url in where.items()}
        prom.deaths = [(moved[d.instance], d.rank, d.restart, d.killer, d.at) for d in seen.deaths]
        prom.ranks = [(moved[r.instance], r.rank, r.local_rank, r.pid, r.restart) for r in seen.ranks]
        prom.last_round = {moved[i]: seen.asked_at for i in seen.nodes}
        return prom

    def _vector(self, rows: list[tuple[dict[str, str], float]]) -> bytes:
        return _api(
            {"resultType": "vector", "result": [{"metric": m, "value": [self.now, repr(v)]} for m, v in rows]}
        )

    def _matrix(self, rows: dict[str, list[tuple[float, float]]]) -> bytes:
        result = [
            {"metric": {"instance": i}, "values": [[t, repr(v)] for t, v in s]} for i, s in rows.items()
        ]
        return _api({"resultType": "matrix", "result": result})

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        q = parse_qs(parts.query).get("query", [""])[0]
        job = _job_of(q) or "newest"
        if parts.path.endswith("/targets"):
            targets = [
                {
                    "labels": {"instance": i},
                    "scrapeUrl": u,
                    "health": "up",
                    "lastError": "",
                    "lastScrape": None,
                }
                for i, u in self.urls.items()
            ]
            body = _api({"activeTargets": targets})
        elif parts.path.endswith("/status/flags"):
            body = _api({"scrape.timestamp-tolerance": "2ms"})
        elif q.startswith("max by (job)"):
            body = self._vector([({"job": "newest"}, max(d[4] for d in self.deaths))])
        elif "trainwatch_rank_death_timestamp_seconds" in q:
            body = self._vector(
                [
                    ({"instance": i, "rank": r, "restart": str(n), "killer": k, "job": job}, at)
                    for i, r, n, k, at in self.deaths
                ]
            )
        elif "trainwatch_rank_info" in q:
            body = self._vector(
                [
                    (
                        {"instance": i, "rank": r, "local_rank": lr, "pid": p, "restart": str(n), "job": job},
                        1.0,
                    )
                    for i, r, lr, p, n in self.ranks
                ]
            )
        elif q.startswith("last_over_time(trainwatch_last_sample_timestamp_seconds"):
            body = self._vector([({"instance": i}, v) for i, v in self.last_round.items()])
        elif q.startswith("trainwatch_time_seconds"):
            body = self._matrix({i: [(t, v) for t, v, _ in s] for i, s in self.clock.items()})
        elif q.startswith("scrape_duration_seconds"):
            body = self._matrix({i: [(t, d) for t, _, d in s] for i, s in self.clock.items()})
        else:
            body = self._matrix({})
        reply(body)(h)


class NodeDaemon:
    """One node's daemon as ``story`` reads it: ``/postmortems?job=`` and
    ``/postmortems/{id}``, its documents recorded (any job name asked gets them, the job
    key rewritten to the job its list was last asked for: one story at a time)."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = {d["id"]: d for d in docs}
        self.bodies: dict[tuple[str, str, bool], bytes] = {}
        self.job = next(iter(docs))["job"]["key"] if docs else ""

    def _doc(self, ident: str, job: str, summary: bool) -> bytes:
        key = (ident, job, summary)
        if key not in self.bodies:
            doc = copy.deepcopy(self.docs[ident])
            doc["job"]["key"] = job
            if summary:  # as the daemon answers ?view=summary
                del doc["timeline"]
            self.bodies[key] = json.dumps(doc).encode()
        return self.bodies[key]

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        if parts.path == "/postmortems":
            self.job = parse_qs(parts.query).get("job", [""])[0]
            listing = [{"id": i, "job": self.job} for i in self.docs]
            return reply(json.dumps(listing).encode())(h)
        ident = parts.path.rsplit("/", 1)[-1]
        if ident not in self.docs:
            return reply(b'{"detail":"no such postmortem"}', 404)(h)
        summary = parse_qs(parts.query).get("view") == ["summary"]
        return reply(self._doc(ident, self.job, summary))(h)


class Cluster:
    """``nodes`` nodes made from the recorded real two-node run: node 0 is the recorded
    node whose rank died of its own cause (its memory cgroup), every other node repeats
    the node that followed (a rank whose gloo collective failed, a rank its agent
    stopped), each with ``ranks_per_node`` ranks and a timeline of ``history`` samples (the
    daemon's default history at 1 Hz is 600), deaths a few ms apart from node to node."""

    def __init__(self, nodes: int = 64, ranks_per_node: int = 8, history: int = 600) -> None:
        seen = recorded("two-nodes-seen.json")
        first = next(i for i, n in seen.nodes.items() if n.docs[0]["killer"]["kind"] == "cgroup_oom")
        follow = next(i for i in seen.nodes if i != first)
        self.templates = (seen.nodes[first].docs[0], seen.nodes[follow].docs[0])
        self.nodes, self.per, self.history = nodes, ranks_per_node, history
        self.t0 = epoch_of(self.templates[0]["victim"]["died_at"]) or 0.0

    def _doc(self, k: int) -> dict[str, Any]:
        doc = copy.deepcopy(self.templates[0 if k == 0 else 1])
        base = k * self.per
        victim = doc["victim"]
        (vfate_rank,) = [r for r in doc["ranks"] if r["fate"] == "root_cause"]
        (other,) = [r for r in doc["ranks"] if r["fate"] != "root_cause"]
        died = self.t0 + (0 if k == 0 else 0.7 + 0.003 * k)
        ranks = []
        for i in range(self.per):
            r = copy.deepcopy(vfate_rank if i == 0 else other)
            r.update(
                rank=base + i,
                local_rank=i,
                pid=10_000 + base + i,
                died_at=iso(died + (0 if i == 0 else 0.05)),
            )
            ranks.append(r)
        victim.update(rank=base, local_rank=0, pid=10_000 + base, died_at=iso(died))
        doc["ranks"] = ranks
        doc["id"] = f"20261205T051013Z-node{k}-{20_000 + k}-r{base}"
        doc["host"] = f"node{k}"
        doc["job"].update(world_size=self.nodes * self.per)
        sample = doc["timeline"][-1] if doc["timeline"] else {}
        doc["timeline"] = [
            {
                **sample,
                "at": iso(died - (self.history - j)),
                "rss_bytes": {str(base + i): 1 << 30 for i in range(self.per)},
                "tree_rss_bytes": {str(base + i): 5 << 29 for i in range(self.per)},
            }
            for j in range(self.history)
        ]
        return doc

    @contextmanager
    def serve(self) -> Iterator[str]:
        """Every node's daemon and the Prometheus API up: the Prometheus URL."""
        prom = PromAnswers()
        prom.now = self.t0 + 60
        with ExitStack() as stack:
            for k in range(self.nodes):
                doc = self._doc(k)
                url = stack.enter_context(server(NodeDaemon([doc]).handle))
                inst = url.removeprefix("http://")
                prom.urls[inst] = url + "/metrics"
                prom.last_round[inst] = prom.now
                for r in doc["ranks"]:
                    kind = doc["killer"]["kind"] if r["fate"] == "root_cause" else "agent_teardown"
                    at = epoch_of(r["died_at"]) or 0.0
                    prom.deaths.append((inst, str(r["rank"]), 0, kind, at))
                    prom.ranks.append((inst, str(r["rank"]), str(r["local_rank"]), str(r["pid"]), 0))
                # a scrape a second for 4 minutes around the deaths, each 3 ms long
                prom.clock[inst] = [(self.t0 - 120 + s, self.t0 - 120 + s + 0.001, 0.003) for s in range(240)]
            yield stack.enter_context(server(prom.handle))
