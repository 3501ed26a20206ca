"""The HTTP app: ``create_app(daemon)`` returns a FastAPI app whose lifespan starts and
stops the daemon's threads. Handlers read the latest snapshot only; none does I/O or
waits for the sampler.

Routes: ``/metrics`` (Prometheus text, OpenMetrics when asked for), ``/ranks`` (the live
view as JSON), ``/healthz`` (200 while the sampler is alive and not stalled, else 503).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from sidecar import __version__
from sidecar.daemon import Daemon
from sidecar.metrics.collector import TrainwatchCollector
from sidecar.metrics.exposition import CONTENT_TYPE_OPENMETRICS, CONTENT_TYPE_TEXT
from sidecar.metrics.families import with_clock
from sidecar.model import CgroupSample, Snapshot
from sidecar.postmortem import render_text
from sidecar.postmortem.html import render_html
from sidecar.redact import redact_doc
from sidecar.story.fetch import PeerConfig
from sidecar.story.render import render_html as render_story_html
from sidecar.story.render import render_text as render_story_text
from sidecar.web.guard import WebStats

__all__ = ["create_app", "ranks_view"]


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
    collector = TrainwatchCollector(
        lambda: daemon.snapshot,
        deaths=lambda: dict(daemon.deaths.deaths_total),
        postmortems=lambda: daemon.store.written_total,
        death_times=lambda: daemon.deaths.death_times,
        protection=lambda: [(g.kind, g.granted) for g in daemon.protection],
        lost=daemon.lost_events,
        web=lambda: _web_figures(web_stats),
    )
    app.state.daemon = daemon

    # The last body rendered, and what it was rendered from: scrapes between two rounds (a
    # second Prometheus, a dashboard, a retry) are served the same bytes without rendering.
    rendered: list[tuple[Any, tuple[Any, ...], bytes]] = []

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        # OpenMetrics when the scraper lists it (Prometheus does, first), else text 0.0.4.
        openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
        snap = daemon.snapshot
        deaths = daemon.deaths
        made_of = (
            openmetrics,
            daemon.store.written_total,
            tuple(deaths.deaths_total.items()),
            tuple(deaths.death_times.items()),
            tuple(daemon.lost_events().items()),
            tuple((g.kind, g.granted) for g in daemon.protection),
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
        return JSONResponse(
            ranks_view(daemon.snapshot, daemon.settings.stall_after_seconds, daemon.stalls.stall)
        )

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
        if wanted == "html" or (wanted is None and _prefers_html(request.headers.get("accept", ""))):
            return HTMLResponse(page(doc))
        return JSONResponse(doc)

    @app.get("/postmortem")
    def postmortem(request: Request) -> Response:
        doc = daemon.store.newest()
        if doc is None:
            return JSONResponse({"detail": "no postmortem yet: no rank has died abnormally"}, status_code=404)
        return present(doc, request)

    @app.get("/postmortems")
    def postmortems(request: Request) -> JSONResponse:
        # ?job=KEY: one job's postmortems (what ``trainwatch story`` asks each node for)
        return JSONResponse(daemon.store.listing(request.query_params.get("job")))

    @app.get("/postmortems/{ident}")
    def postmortem_by_id(ident: str, request: Request) -> Response:
        doc = daemon.store.get(ident)
        if doc is None:
            return JSONResponse({"detail": f"no postmortem with id {ident!r}"}, status_code=404)
        if request.query_params.get("view") == "summary":  # what story reads: all but the memory curve
            return JSONResponse({k: v for k, v in doc.items() if k != "timeline"})
        return present(doc, request)

    story = StoryRoute(daemon.settings.prometheus, peers)

    @app.get("/story")
    def story_route(request: Request) -> Response:
        job = request.query_params.get("job")
        status, doc = story.answer(job)
        if status != 200:
            return JSONResponse(doc, status_code=status)
        return present(doc, request, render_story_text, render_story_html)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        ok, why = daemon.healthy()
        return JSONResponse(
            {"status": "ok" if ok else "unhealthy", "detail": why}, status_code=200 if ok else 503
        )

    return app


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


def _prefers_html(accept: str) -> bool:
    """True when the client ranks text/html above application/json (a browser does)."""

    def quality(media: str) -> float:
        best = 0.0
        for part in accept.split(","):
            name, *params = (p.strip() for p in part.split(";"))
            if name in (media, media.split("/")[0] + "/*"):
                q = next(
                    (
                        float(p[2:])
                        for p in params
                        if p.startswith("q=") and p[2:].replace(".", "", 1).isdigit()
                    ),
                    1.0,
                )
                best = max(best, q * (1.0 if name == media else 0.99))
        return best

    return quality("text/html") > quality("application/json")


def _cgroup_view(c: CgroupSample) -> dict[str, Any]:
    """A memory cgroup as ``/ranks`` shows it, in the job list and under each rank alike."""
    return {
        "path": c.path,
        "version": c.version,
        "usage_bytes": c.usage_bytes,
        "limit_bytes": c.limit_bytes,
        "peak_bytes": c.peak_bytes,
        "oom_kills": c.oom_kills,
        "limited_by": c.limited_by,
        "effective_limit_bytes": c.effective_limit_bytes,
        "ancestors": [{"path": a.path, "limit_bytes": a.limit_bytes} for a in c.ancestors],
        "exhaustion_seconds": c.exhaustion_seconds,
    }


def ranks_view(
    snap: Snapshot | None,
    stall_after: float = 60.0,
    stall_of: Callable[[str], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The JSON of ``GET /ranks``: attached jobs, their ranks and the last sample of each."""
    if snap is None:
        return {"taken_at": None, "jobs": [], "host": None, "gpus": [], "cgroups": [], "probes": {}}
    cgroups = {c.path: c for c in snap.cgroups}
    jobs = []
    for job in snap.jobs:
        ranks = []
        for r in job.ranks:
            cg = cgroups.get(r.cgroup) if r.cgroup else None
            p = r.progress
            ranks.append(
                {
                    "rank": r.rank,
                    "label": r.rank_label,
                    "local_rank": r.local_rank,
                    "rank_source": r.rank_source,
                    "restart": r.restart,
                    "pid": r.key.pid,
                    "ns_pids": list(r.ns_pids),
                    "rss_bytes": r.rss_bytes,
                    "peak_rss_bytes": r.peak_rss_bytes,
                    "tree_rss_bytes": r.tree_rss_bytes,
                    "tree_pss_bytes": r.tree_pss_bytes,
                    "tree_uss_bytes": r.tree_uss_bytes,
                    "tree_processes": r.tree_processes,
                    # each descendant's USS, and its growth since first measured (copy-on-access)
                    "workers": [
                        {"pid": pid, "uss_bytes": uss, "uss_growth_bytes": uss - first}
                        for pid, uss, first in r.workers_uss
                    ],
                    "exhaustion_seconds": r.exhaustion_seconds,
                    "binding_limit": None
                    if r.binding_limit is None
                    else {
                        "kind": r.binding_limit.kind,
                        "path": r.binding_limit.path,
                        "limit_bytes": r.binding_limit.limit_bytes,
                    },
                    "cpu_seconds": round(r.cpu_seconds, 3),
                    "threads": r.threads,
                    "gpu_memory_bytes": {str(k): v for k, v in r.gpu_memory_bytes.items()} or None,
                    # NVML's per-process activity of the rank's tree this round (percent)
                    "gpu_sm_percent": r.gpu_sm_percent,
                    "gpu_memory_percent": r.gpu_memory_percent,
                    "stalled": p is not None and p.stalled_seconds >= stall_after,
                    "stalled_seconds": p.stalled_seconds if p else 0.0,
                    "stall_reason": p.reason if p else None,
                    "cpu_busy": p.cpu_busy if p else None,
                    "gpu_busy": p.gpu_busy if p else None,
                    "cgroup": None if cg is None else _cgroup_view(cg),
                }
            )
        stalled = job.stalled_seconds >= stall_after
        # what a job chose (its entrypoint, run id, the stacks of its ranks) goes through the redactor
        jobs.append(
            redact_doc(
                {
                    "job": job.key,
                    "launcher": job.launcher,
                    "agent_pid": job.agent.pid,
                    "run_id": job.run_id,
                    "world_size": job.world_size,
                    "restart_count": job.restart_count,
                    "max_restarts": job.max_restarts,
                    "entrypoint": job.entrypoint,
                    "started_at": job.started_at,
                    "agent_alive": job.agent_alive,
                    "stalled_seconds": job.stalled_seconds,
                    "stalled": stalled,
                    "suspected_missing": list(job.suspected_missing) if stalled else [],
                    # the snapshot taken when the stall reached --stall-after (sampling/stalls.py)
                    "stall": stall_of(job.key) if stall_of is not None and stalled else None,
                    # ranks alive and making no progress after another's death (sampling/stranded.py)
                    "stranded": None
                    if job.stranded is None
                    else {
                        "since": job.stranded.since,
                        "dead_ranks": list(job.stranded.dead_ranks),
                        "ranks": list(job.stranded.ranks),
                        "gpu_memory_bytes": job.stranded.gpu_memory_bytes,
                    },
                    "ranks": ranks,
                }
            )
        )
    host = snap.host
    return {
        "taken_at": snap.taken_at,
        "jobs": jobs,
        "host": None
        if host is None
        else {
            "total_bytes": host.total_bytes,
            "available_bytes": host.available_bytes,
            "oom_kills": host.oom_kills,
            "memory_pressure_some_ratio": host.psi_some_avg10_ratio,
            "memory_pressure_full_ratio": host.psi_full_avg10_ratio,
            "shm_used_bytes": host.shm_used_bytes,
            "shm_size_bytes": host.shm_total_bytes,
        },
        "gpus": [
            {
                "index": d.index,
                "uuid": d.uuid,
                "name": d.name,
                "used_bytes": d.used_bytes,
                "total_bytes": d.total_bytes,
                "lost": d.lost,
                "processes": [
                    {
                        "pid": p.pid,
                        "used_bytes": p.used_bytes,
                        "sm_percent": p.sm_percent,
                        "memory_percent": p.memory_percent,
                    }
                    for p in d.processes
                ],
            }
            for d in snap.gpus
        ],
        "cgroups": [_cgroup_view(c) for c in snap.cgroups],
        "probes": {
            name: {"success": s.success, "duration_seconds": s.duration_seconds, "message": s.message}
            for name, s in snap.probes.items()
        },
        "unreadable_processes": snap.unreadable_processes,
        "samples_total": snap.samples_total,
        "overruns_total": snap.overruns_total,
    }
