"""What ``--web-config`` asks of every connection and request, re-read when the file (or a
file it names) changes, as the exporter toolkit reads it per connection:

* ``Reloader``: the current ``WebConfig`` and its TLS context; checks the files' identity
  at most once a second; a new file that does not load keeps the old one, with an error in
  the log and ``trainwatch_web_config_last_reload_successful`` at 0.
* ``ReloadingSSLObject``: each new TLS connection takes the current context (certificate,
  client CAs, versions, ciphers), and its client certificate must carry one of
  ``client_allowed_sans`` or the connection ends after the handshake.
* ``WebGuard``: ASGI middleware, in the toolkit's order: the rate limit (429), the
  configured response headers (on every answer, refusals too), then basic authentication.
  An unknown user pays a bcrypt check against a hash of the users' usual cost, so the time
  of a refusal does not tell which user names exist; a pair that matched is remembered as a
  salted digest so a scrape every few seconds does not pay bcrypt each time.

``/healthz`` needs no credentials (orchestrators' probes carry none; it tells only whether
the sampler runs).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from sidecar.errors import ConfigError
from sidecar.web.config import WebConfig, load

__all__ = ["Reloader", "ReloadingSSLObject", "WebGuard", "WebStats"]

log = logging.getLogger(__name__)
UNAUTHENTICATED = frozenset({"/healthz"})
CHECK_EVERY_S = 1.0

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class WebStats:
    """Counted for the metrics (``trainwatch_http_*``): refusals by cause, reloads."""

    auth_failures: int = 0
    rate_limited: int = 0
    tls_refused: int = 0  # client certificates without an allowed SAN
    reload_ok: bool = True
    reloads: int = 0


def _identity(files: tuple[str, ...]) -> tuple[tuple[int, int, int] | None, ...]:
    out: list[tuple[int, int, int] | None] = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


class Reloader:
    def __init__(self, config: WebConfig, stats: WebStats | None = None) -> None:
        self.stats = stats or WebStats()
        self._lock = threading.Lock()
        self._set(config)
        self._checked = time.monotonic()

    def _set(self, config: WebConfig) -> None:
        self.config = config
        self.context = config.ssl_context() if config.tls else None
        self.dummy = _dummy_hash(config.users)
        self._seen = _identity(config.files)

    def current(self) -> WebConfig:
        """The config in force, read again first when a second has passed and a file changed."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return self.config
        with self._lock:
            if now - self._checked < CHECK_EVERY_S:
                return self.config
            self._checked = now
            if _identity(self.config.files) != self._seen:
                self._reload()
        return self.config

    def _reload(self) -> None:
        old = self.config
        try:
            new = load(old.path)
            if new.tls != old.tls:
                raise ConfigError(
                    f"--web-config: {old.path}: TLS cannot be turned on or off without a restart"
                )
            self._set(new)
        except (ConfigError, ssl.SSLError, OSError) as exc:
            self._seen = _identity(old.files)  # say it once per change, not per request
            self.stats.reload_ok = False
            log.error("web config changed but cannot be used; keeping the one in force: %s", exc)
            return
        self.stats.reload_ok = True
        self.stats.reloads += 1
        log.info(
            "web config %s read again: %d user(s), TLS %s",
            new.path,
            len(new.users),
            "on" if new.tls else "off",
        )

    def server_context(self) -> ssl.SSLContext:
        """The context uvicorn listens with: each connection it makes takes the current one."""
        assert self.context is not None
        base = self.config.ssl_context()
        if not hasattr(ssl.SSLObject, "_create"):  # pragma: no cover - a Python without it
            log.warning("this Python's ssl makes connections only from the context at start: "
                        "TLS settings of a changed --web-config apply after a restart")  # fmt: skip
            return base
        # a class of its own per server: two servers in one process never share a config
        base.sslobject_class = type("ReloadingSSLObject", (ReloadingSSLObject,), {"reloader": self})
        return base


class ReloadingSSLObject(ssl.SSLObject):
    """An SSL object made from the context in force when the connection arrives (the
    toolkit's GetConfigForClient), whose handshake ends the connection when the client
    certificate carries none of ``client_allowed_sans`` (its VerifyPeerCertificate)."""

    reloader: Reloader | None = None
    _config: WebConfig | None = None

    @classmethod
    def _create(
        cls,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | None = None,
        session: ssl.SSLSession | None = None,
        context: ssl.SSLContext | None = None,
    ) -> ReloadingSSLObject:
        r = cls.reloader
        if r is not None:
            r.current()
            context = r.context or context
        make = super()._create  # type: ignore[misc]  # ssl's private constructor (3.7 to 3.13)
        obj: ReloadingSSLObject = make(incoming, outgoing, server_side, server_hostname, session, context)
        obj._config = r.config if r is not None else None
        return obj

    def do_handshake(self) -> None:
        super().do_handshake()
        config = self._config
        if (
            config is not None
            and config.allowed_sans is not None
            and not config.san_allowed(self.getpeercert())
        ):
            if self.reloader is not None:
                self.reloader.stats.tls_refused += 1
            raise ssl.SSLError(ssl.SSL_ERROR_SSL, "client certificate has none of client_allowed_sans")


def _cost(hashed: bytes) -> int:
    try:
        return int(hashed.split(b"$")[2])
    except (IndexError, ValueError):
        return 10


def _dummy_hash(users: dict[str, bytes]) -> bytes:
    """What an unknown user's password is checked against: a configured user's hash of the
    users' usual (median) cost, so refusing an unknown name costs what refusing a known one
    does. (It cannot let anyone in: an unknown name is refused whatever the check says.)"""
    if not users:
        return b""
    ranked = sorted(users.values(), key=_cost)
    return ranked[(len(ranked) - 1) // 2]


class _Bucket:
    """The toolkit's rate.Limiter(Every(interval), burst): a token each interval, at most
    burst kept; a request without a token is refused."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.at = time.monotonic()
        self.lock = threading.Lock()

    def allow(self, interval: float, burst: int) -> bool:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(float(burst), self.tokens + (now - self.at) / interval)
            self.at = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return True
            return False


class WebGuard:
    def __init__(self, app: ASGIApp, reloader: Reloader) -> None:
        self.app = app
        self.reloader = reloader
        self.stats = reloader.stats
        self._salt = secrets.token_bytes(16)
        self._good: set[bytes] = set()  # digests of (user, password, hash) that matched
        self._lock = threading.Lock()
        self._limiter: Any = None  # anyio's CapacityLimiter(1), made inside the event loop
        self._bucket = _Bucket()

    async def _ok(self, config: WebConfig, header: bytes | None) -> bool:
        if not header or header[:6].lower() != b"basic ":
            return False
        try:
            user, _, password = base64.b64decode(header[6:].strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        hashed = config.users.get(user.decode("utf-8", "replace"))
        known = hashed is not None
        checked = hashed if hashed is not None else self.reloader.dummy
        digest = hashlib.sha256(self._salt + user + b"\0" + password + b"\0" + checked).digest()
        with self._lock:
            if known and any(hmac.compare_digest(digest, g) for g in self._good):
                return True
        import anyio
        import anyio.to_thread
        import bcrypt

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        # bcrypt costs tens of milliseconds by design: on a worker thread, one at a time, so
        # guessing neither blocks the event loop (scrapes, /healthz) nor takes more than a core;
        # an unknown user is checked too, against a hash of the same cost (no timing oracle)
        matched = await anyio.to_thread.run_sync(bcrypt.checkpw, password, checked, limiter=self._limiter)
        if not (matched and known):
            return False
        with self._lock:
            if len(self._good) > 256:
                self._good.clear()
            self._good.add(digest)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        config = self.reloader.current()
        extra = [(k.lower().encode(), v.encode()) for k, v in config.headers.items()]

        async def send_with_headers(message: MutableMapping[str, Any]) -> None:
            if extra and message["type"] == "http.response.start":
                names = {k for k, _ in extra}
                kept = [(k, v) for k, v in message.get("headers") or [] if k.lower() not in names]
                message = {**message, "headers": kept + extra}
            await send(message)

        if config.rate_interval > 0 and not self._bucket.allow(config.rate_interval, config.rate_burst):
            self.stats.rate_limited += 1
            await _refuse(send_with_headers, 429, b"Too Many Requests\n", [])
            return
        if not config.users or scope.get("path") in UNAUTHENTICATED:
            await self.app(scope, receive, send_with_headers)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
        if await self._ok(config, header):
            await self.app(scope, receive, send_with_headers)
            return
        self.stats.auth_failures += 1
        await _refuse(
            send_with_headers, 401, b"Unauthorized\n", [(b"www-authenticate", b'Basic realm="trainwatch"')]
        )


async def _refuse(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-type", b"text/plain; charset=utf-8")],
        }
    )
    await send({"type": "http.response.body", "body": body})
