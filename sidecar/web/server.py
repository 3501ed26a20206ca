"""The HTTP app: ``create_app(daemon)`` returns a FastAPI app whose lifespan starts and
stops the daemon's threads. The routes are handed what they serve (``Served``): readers of
the latest snapshot, the death ledger and the postmortems, none of which does I/O or waits
for the sampler.

Routes: ``/metrics`` (Prometheus text, OpenMetrics when asked for), ``/ranks`` (the live
view as JSON, ``views.py``), ``/postmortem`` and ``/postmortems`` (the documents),
``/story`` (a job's death across nodes), ``/healthz`` (200 while the sampler is alive and not
stalled, else 503).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from sidecar import __version__
from sidecar.daemon import Daemon
from sidecar.metrics.collector import TrainwatchCollector
from sidecar.metrics.exposition import CONTENT_TYPE_OPENMETRICS, CONTENT_TYPE_TEXT
from sidecar.metrics.families import with_clock
from sidecar.model import Snapshot
from sidecar.model.ledger import DeathLedger
from sidecar.model.stall import StallSnapshot
from sidecar.postmortem import PostmortemStore, render_text
from sidecar.postmortem.html import render_html
from sidecar.story.fetch import PeerConfig
from sidecar.story.render import render_html as render_story_html
from sidecar.story.render import render_text as render_story_text
from sidecar.web.guard import WebStats
from sidecar.web.views import prefers_html, ranks_view

__all__ = ["Served", "create_app", "ranks_view"]


@dataclass(frozen=True, slots=True)
class Served:
    """What the routes serve, each read when a request comes and none waiting on the
    sampler: the latest snapshot, the deaths counted, the postmortems, a job's stall
    snapshot, the sampler's health, the events lost, the protections granted."""

    snapshot: Callable[[], Snapshot | None]
    ledger: Callable[[], DeathLedger]
    postmortems: PostmortemStore
    stall_of: Callable[[str], StallSnapshot | None]
    stall_after_seconds: float
    healthy: Callable[[], tuple[bool, str]]
    lost: Callable[[], dict[str, int]]
    protection: Callable[[], tuple[tuple[str, bool], ...]]
    prometheus: str | None

    @classmethod
    def of(cls, daemon: Daemon) -> Served:
        """The daemon's readers: the one place the web reaches into it."""
        return cls(
            snapshot=lambda: daemon.snapshot,
            ledger=lambda: daemon.deaths.ledger,
            postmortems=daemon.store,
            stall_of=daemon.stalls.stall,
            stall_after_seconds=daemon.settings.stall_after_seconds,
            healthy=daemon.healthy,
            lost=daemon.lost_events,
            protection=lambda: tuple((g.kind, g.granted) for g in daemon.protection),
            prometheus=daemon.settings.prometheus,
        )


def create_app(
    daemon: Daemon,
    *,
    manage_daemon: bool = True,
    peers: PeerConfig | None = None,
    web_stats: WebStats | None = None,
) -> FastAPI:
    """The app. With ``manage_daemon`` the lifespan starts the sampler and stops it
    (finishing the round in flight) on shutdown; tests that drive the daemon themselves
    pass False. ``peers``: the credentials ``/story`` reads other nodes with."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_daemon:
            daemon.start()
        try:
            yield
        finally:
            if manage_daemon:
                daemon.stop()

    app = FastAPI(title="trainwatch", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    _routes(app, Served.of(daemon), peers, web_stats)
    return app


def _routes(app: FastAPI, served: Served, peers: PeerConfig | None, web_stats: WebStats | None) -> None:
    """Every route, reading ``served`` only."""
    store = served.postmortems
    collector = TrainwatchCollector(
        served.snapshot,
        deaths=served.ledger,
        postmortems=lambda: store.written_total,
        protection=served.protection,
        lost=served.lost,
        web=lambda: _web_figures(web_stats),
    )

    # The last body rendered, and what it was rendered from: scrapes between two rounds (a
    # second Prometheus, a dashboard, a retry) are served the same bytes without rendering.
    rendered: list[tuple[Any, tuple[Any, ...], bytes]] = []

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        # OpenMetrics when the scraper lists it (Prometheus does, first), else text 0.0.4.
        openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
        snap = served.snapshot()
        made_of = (
            openmetrics,
            store.written_total,
            served.ledger(),  # immutable: a new death is a new ledger
            tuple(served.lost().items()),
            served.protection(),
            _web_figures(web_stats),
        )
        cached = rendered[0] if rendered else None
        if cached is not None and cached[0] is snap and cached[1] == made_of:
            body = cached[2]
        else:
            body = collector.exposition(openmetrics)
            rendered[:] = [(snap, made_of, body)]
        return Response(
            content=with_clock(body, openmetrics, time.time()),
            media_type=CONTENT_TYPE_OPENMETRICS if openmetrics else CONTENT_TYPE_TEXT,
        )

    @app.get("/ranks")
    def ranks() -> JSONResponse:
        return JSONResponse(ranks_view(served.snapshot(), served.stall_after_seconds, served.stall_of))

    def present(
        doc: dict[str, Any],
        request: Request,
        text: Callable[[dict[str, Any]], str] = render_text,
        page: Callable[[dict[str, Any]], str] = render_html,
    ) -> Response:
        """``?format=text|html|json``; without it, HTML for a client that prefers it."""
        wanted = request.query_params.get("format")
        if wanted == "text":
            return PlainTextResponse(text(doc))
        if wanted == "html" or (wanted is None and prefers_html(request.headers.get("accept", ""))):
            return HTMLResponse(page(doc))
        return JSONResponse(doc)

    @app.get("/postmortem")
    def postmortem(request: Request) -> Response:
        doc = store.newest()
        if doc is None:
            return JSONResponse({"detail": "no postmortem yet: no rank has died abnormally"}, status_code=404)
        return present(doc, request)

    @app.get("/postmortems")
    def postmortems(request: Request) -> JSONResponse:
        # ?job=KEY: one job's postmortems (what ``trainwatch story`` asks each node for)
        return JSONResponse(store.listing(request.query_params.get("job")))

    @app.get("/postmortems/{ident}")
    def postmortem_by_id(ident: str, request: Request) -> Response:
        doc = store.get(ident)
        if doc is None:
            return JSONResponse({"detail": f"no postmortem with id {ident!r}"}, status_code=404)
        if request.query_params.get("view") == "summary":  # what story reads: all but the memory curve
            return JSONResponse({k: v for k, v in doc.items() if k != "timeline"})
        return present(doc, request)

    story = StoryRoute(served.prometheus, peers)

    @app.get("/story")
    def story_route(request: Request) -> Response:
        job = request.query_params.get("job")
        status, doc = story.answer(job)
        if status != 200:
            return JSONResponse(doc, status_code=status)
        return present(doc, request, render_story_text, render_story_html)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        ok, why = served.healthy()
        return JSONResponse(
            {"status": "ok" if ok else "unhealthy", "detail": why}, status_code=200 if ok else 503
        )


def _web_figures(stats: WebStats | None) -> tuple[int, int, int, bool] | None:
    if stats is None:
        return None
    return (stats.auth_failures, stats.rate_limited, stats.tls_refused, stats.reload_ok)


class StoryRoute:
    """``GET /story``: one story at a time (each asks Prometheus and every node), and the
    last answer per job reused for a few seconds, so a dashboard's clicks or a hostile
    client's loop cannot turn this daemon into a load on every node of the cluster."""

    FRESH_S = 5.0

    def __init__(self, prometheus: str | None, peers: PeerConfig | None) -> None:
        self.prometheus = prometheus
        self.peers = peers
        self._lock = threading.Lock()
        self._cache: dict[str | None, tuple[float, int, dict[str, Any]]] = {}

    def answer(self, job: str | None) -> tuple[int, dict[str, Any]]:
        if self.prometheus is None:
            return 404, {"detail": "this daemon was not started with --prometheus URL: no story"}
        if job is not None and (not job or len(job) > 256):
            return 400, {"detail": "job: expected the job's run id (1 to 256 characters)"}
        with self._lock:  # the next asker waits, then finds this one's answer
            hit = self._cache.get(job)
            if hit is not None and time.monotonic() - hit[0] < self.FRESH_S:
                return hit[1], hit[2]
            from sidecar.story import NoDeath, PromError, tell

            try:
                status, doc = 200, tell(self.prometheus, job, peers=self.peers)
            except NoDeath as exc:
                status, doc = 404, {"detail": str(exc)}
            except PromError as exc:
                status, doc = 503, {"detail": str(exc)}
            if len(self._cache) > 32:
                self._cache.clear()
            self._cache[job] = (time.monotonic(), status, doc)
            return status, doc
