"""The daemon and its HTTP server, started and stopped together: ``serve`` runs one until
SIGINT/SIGTERM (``trainwatch --attach-torchrun``); ``trainwatch run`` runs one beside the
job it starts. Logging is configured here too, the same way for both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from sidecar import __version__, lognames
from sidecar.errors import ConfigError
from sidecar.redact import RedactingFilter
from sidecar.settings import Settings

__all__ = ["Service", "configure_logging", "serve"]

log = logging.getLogger(lognames.FRONT)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:  # a rank's line quoted in a warning, an argv
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    if level != "DEBUG":
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _listen(settings: Settings) -> socket.socket:
    try:
        infos = socket.getaddrinfo(
            settings.host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(f"--host: cannot resolve {settings.host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"--port: cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
        ) from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def _prepare_postmortem_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=0o750, exist_ok=True)
    except OSError as exc:
        log.warning(
            "postmortem directory %s is not usable (%s): postmortems will be kept in memory only",
            path,
            exc.strerror,
        )
        return
    if not os.access(path, os.W_OK):
        log.warning("postmortem directory %s is not writable: postmortems will be kept in memory only", path)


class _FreshDate:
    """Refreshes uvicorn's Date header when a request comes and the last refresh is a
    second old: what its main loop's tick did, without the tick."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server: Any = None
        self._at = 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.server is not None:
            now = time.monotonic()
            if now - self._at >= 1.0:
                self._at = now
                await self.server.on_tick(0)  # counter 0: refresh the default headers
        await self.app(scope, receive, send)


def _quiet_server_class() -> type:
    import asyncio

    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn's main loop wakes every 0.1 s to look for a shutdown request and refresh
        its Date header: 0.23% of a core on an idle node, measured. A guest on a training
        node never ticks: the loop sleeps until ``request_exit()`` (from any thread), and
        the Date header is refreshed by the request that needs it (``_FreshDate``)."""

        _exit: asyncio.Event | None = None
        _loop: asyncio.AbstractEventLoop | None = None

        async def main_loop(self) -> None:
            self._loop = asyncio.get_running_loop()
            self._exit = asyncio.Event()
            if self.should_exit:  # asked before the loop ran
                return
            await self._exit.wait()

        def request_exit(self) -> None:
            self.should_exit = True
            loop, event = self._loop, self._exit
            if loop is not None and event is not None:
                with contextlib.suppress(RuntimeError):  # the loop already closed
                    loop.call_soon_threadsafe(event.set)

    return QuietServer


class Service:
    """The daemon and its HTTP server, started and stopped together (``serve`` runs one
    until a signal; ``trainwatch run`` runs one beside the job it starts)."""

    def __init__(self, settings: Settings, job_output: Callable[[int], str] | None = None) -> None:
        self.settings = settings
        self.job_output = job_output
        self.url = ""
        self._done = threading.Event()
        self._done_r, self._done_w = os.pipe()  # readable once the server has ended
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen, start sampling and serving. Raises ConfigError for a bad --pid/--port."""
        import uvicorn

        from sidecar.daemon import Daemon
        from sidecar.front.doctor import checks, summary_line
        from sidecar.web.server import create_app

        settings = self.settings
        for pid in settings.pids:
            if not os.path.exists(f"{settings.proc_root}/{pid}"):
                raise ConfigError(f"--pid {pid}: no such process (give the pid of a running torchrun agent)")
        web = None
        web_stats = None
        if settings.web_config is not None:
            from sidecar.web import config as webconfig
            from sidecar.web.guard import Reloader, WebStats

            web_stats = WebStats()
            reloader = Reloader(webconfig.load(settings.web_config), web_stats)
            web = reloader.config
        peers = None
        if settings.prometheus is not None:
            from sidecar.story import load_peer_config

            peers = load_peer_config(settings.peer_config)  # a bad file stops the start, naming its key
        self._sock = _listen(settings)
        host, port = self._sock.getsockname()[:2]
        _prepare_postmortem_dir(settings.postmortem_dir)
        # the daemon subscribes to the connector itself and logs how that went
        log.info("%s", summary_line(checks(settings, connector=False, installation=False)))
        self.daemon = Daemon(settings, job_output=self.job_output)
        app: Any = create_app(self.daemon, peers=peers, web_stats=web_stats)
        if web is not None:
            from sidecar.web.guard import WebGuard

            app = WebGuard(app, reloader)  # rate limit, headers, basic auth; the file read again on change
        app = fresh_date = _FreshDate(app)
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="on",
            log_level="debug" if settings.log_level == "DEBUG" else "warning",
            timeout_graceful_shutdown=5,
        )
        if web is not None and web.tls:
            config.load()
            config.ssl = reloader.server_context()  # each connection takes the config in force
        self.server = fresh_date.server = _quiet_server_class()(config)
        shown = host if ":" not in host else f"[{host}]"
        scheme = "https" if web is not None and web.tls else "http"
        self.url = f"{scheme}://{shown}:{port}"
        if web is not None:
            log.info(
                "web config %s: %s, %s",
                web.path,
                f"TLS ({web.min_version} to {web.max_version}, client certificates: {web.client_auth}"
                + (f", allowed SANs {sorted(web.allowed_sans)}" if web.allowed_sans is not None else "")
                + ")"
                if web.tls
                else "no TLS",
                f"basic auth for {len(web.users)} user(s), /healthz open" if web.users else "no basic auth",
            )
            if web.headers or web.rate_interval:
                limit = f"{web.rate_burst} per {web.rate_interval:g} s" if web.rate_interval else "none"
                log.info("web config: headers %s, rate limit %s", sorted(web.headers) or "none", limit)

        def run_server() -> None:
            try:
                self.server.run(sockets=[self._sock])
            finally:
                self._done.set()
                os.write(self._done_w, b"x")

        self._thread = threading.Thread(target=run_server, name="trainwatch-http")
        log.info(
            "trainwatch %s: watching %s every %gs; serving %s/metrics (also /ranks, /healthz)",
            __version__,
            f"agents {', '.join(map(str, settings.pids))}"
            if settings.pids
            else "every torchrun, DeepSpeed, torch.multiprocessing.spawn, Lightning, MPI and Slurm job",
            settings.interval_seconds,
            self.url,
        )
        self._thread.start()

    def wait(self, signals_fd: int | None = None) -> None:
        """Until the server has ended. ``signals_fd``: the read end of the signal wakeup fd
        (``serve``): a signal may be delivered to any thread, and Python runs its handler
        only when the main thread next runs, so the main thread must wake for it. A wait
        on a lock would not (and a poll with a timeout would wake the daemon for nothing)."""
        if signals_fd is None:
            self._done.wait()
            return
        while not self._done.is_set():
            ready, _, _ = select.select([self._done_r, signals_fd], [], [])
            if signals_fd in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(signals_fd, 512)  # the handlers run as this thread goes on

    def stop(self) -> bool:
        """Stop serving (the app's lifespan stops the daemon, which finishes postmortems in
        flight). True when the server had started."""
        self.server.request_exit()
        self.wait()
        if self._thread is not None:
            self._thread.join()
        self._sock.close()
        for fd in (self._done_r, self._done_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        return bool(self.server.started)


def serve(settings: Settings) -> int:
    """Run the daemon until SIGINT/SIGTERM. Returns the exit status."""
    service = Service(settings)
    service.start()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        service.server.request_exit()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    try:
        service.wait(wake_r)
    finally:
        signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
    if not service.stop():
        log.error("the HTTP server failed to start")
        return 1
    log.info("stopped")
    return 0
