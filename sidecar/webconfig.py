"""``--web-config FILE``: TLS and basic authentication for the HTTP server, in the format of
the Prometheus exporter toolkit, so the files Prometheus users already keep for
node_exporter work here, and Prometheus's own ``tls_config`` and ``basic_auth`` scrape it.

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default), ...
      client_ca_file: ca.crt
      min_version: TLS12             # TLS10..TLS13 (default TLS12)
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')

Basic authentication applies to every route but ``/healthz`` (it tells only whether the
sampler runs, and orchestrators' probes carry no credentials). A password that matched is
remembered (as a salted digest) so a scrape every few seconds does not pay bcrypt's cost
each time. Needs the ``web`` extra (``pip install trainwatch[web]``: PyYAML and bcrypt).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import ssl
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.errors import ConfigError

__all__ = ["BasicAuth", "WebConfig", "load"]

CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
UNAUTHENTICATED = frozenset({"/healthz"})


@dataclass(frozen=True)
class WebConfig:
    path: str
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None
    client_auth: str = "NoClientCert"
    min_version: str = "TLS12"
    users: dict[str, bytes] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    def ssl_context(self) -> ssl.SSLContext:
        """The server's TLS context: certificate, key, minimum version, client CA."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = VERSIONS[self.min_version]
        assert self.cert_file and self.key_file
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.verify_mode = CLIENT_AUTH[self.client_auth]
        if self.client_ca_file:
            ctx.load_verify_locations(self.client_ca_file)
        return ctx


def load(path: str) -> WebConfig:
    """Read and check the file; ConfigError names what is wrong (the daemon refuses to
    start rather than serve without the protection it was asked for)."""
    try:
        import bcrypt  # noqa: F401  (checked here: a web config without it cannot work)
        import yaml
    except ImportError as exc:
        raise ConfigError(
            f"--web-config needs the web extra: pip install 'trainwatch[web]' (no {exc.name})"
        ) from None
    try:
        with open(path, encoding="utf-8") as f:
            doc: Any = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--web-config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--web-config: {path} is not valid YAML: {exc}") from None
    doc = doc or {}
    if not isinstance(doc, dict):
        raise ConfigError(f"--web-config: {path}: expected a mapping at the top")
    known = {"tls_server_config", "basic_auth_users", "http_server_config"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ConfigError(f"--web-config: {path}: unknown keys {unknown} (expected {sorted(known)})")
    base = os.path.dirname(os.path.abspath(path))

    def where(p: Any, key: str) -> str:
        if not isinstance(p, str) or not p:
            raise ConfigError(f"--web-config: {path}: tls_server_config.{key} must be a file name")
        full = p if os.path.isabs(p) else os.path.join(base, p)
        if not os.path.isfile(full):
            raise ConfigError(f"--web-config: {path}: tls_server_config.{key}: {full} does not exist")
        return full

    tls = doc.get("tls_server_config") or {}
    if not isinstance(tls, dict):
        raise ConfigError(f"--web-config: {path}: tls_server_config must be a mapping")
    cert = where(tls["cert_file"], "cert_file") if "cert_file" in tls else None
    key = where(tls["key_file"], "key_file") if "key_file" in tls else None
    if (cert is None) != (key is None):
        raise ConfigError(f"--web-config: {path}: tls_server_config needs both cert_file and key_file")
    client_auth = tls.get("client_auth_type", "NoClientCert")
    if client_auth not in CLIENT_AUTH:
        raise ConfigError(f"--web-config: {path}: client_auth_type must be one of {', '.join(CLIENT_AUTH)}")
    ca = where(tls["client_ca_file"], "client_ca_file") if "client_ca_file" in tls else None
    if client_auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert") and ca is None:
        raise ConfigError(f"--web-config: {path}: client_auth_type {client_auth} needs client_ca_file")
    min_version = tls.get("min_version", "TLS12")
    if min_version not in VERSIONS:
        raise ConfigError(f"--web-config: {path}: min_version must be one of {', '.join(VERSIONS)}")
    users_doc = doc.get("basic_auth_users") or {}
    if not isinstance(users_doc, dict):
        raise ConfigError(f"--web-config: {path}: basic_auth_users must be a mapping of user: bcrypt hash")
    users = {}
    for user, hashed in users_doc.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise ConfigError(
                f"--web-config: {path}: basic_auth_users.{user}: expected a bcrypt hash ($2y$...)"
            )
        users[str(user)] = hashed.encode()
    cfg = WebConfig(path, cert, key, ca, client_auth, min_version, users)
    if cfg.tls:
        try:
            cfg.ssl_context()
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"--web-config: {path}: the certificate or key cannot be used: {exc}") from None
    return cfg


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BasicAuth:
    """ASGI middleware: HTTP basic authentication against bcrypt hashes."""

    def __init__(self, app: ASGIApp, users: dict[str, bytes]) -> None:
        self.app = app
        self.users = users
        self._salt = secrets.token_bytes(16)
        self._good: set[bytes] = set()  # digests of (user, password) pairs that matched
        self._lock = threading.Lock()
        self._limiter: Any = None  # anyio's CapacityLimiter(1), made inside the event loop

    def _known(self, header: bytes | None) -> tuple[bool | None, bytes, bytes, bytes]:
        """(True: a pair that matched before; False: refused without bcrypt; None: bcrypt
        must tell), then the password, the hash and the pair's digest."""
        if not header or header[:6].lower() != b"basic ":
            return False, b"", b"", b""
        try:
            user, _, password = base64.b64decode(header[6:].strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False, b"", b"", b""
        hashed = self.users.get(user.decode("utf-8", "replace"))
        if hashed is None:
            return False, b"", b"", b""
        digest = hashlib.sha256(self._salt + user + b"\0" + password + b"\0" + hashed).digest()
        with self._lock:
            if any(hmac.compare_digest(digest, g) for g in self._good):
                return True, password, hashed, digest
        return None, password, hashed, digest

    async def _ok(self, header: bytes | None) -> bool:
        known, password, hashed, digest = self._known(header)
        if known is not None:
            return known
        import anyio
        import anyio.to_thread
        import bcrypt

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        # bcrypt costs tens of milliseconds by design: on a worker thread, one at a time,
        # so a client guessing passwords neither blocks the event loop (scrapes, /healthz)
        # nor takes more than one core
        if not await anyio.to_thread.run_sync(bcrypt.checkpw, password, hashed, limiter=self._limiter):
            return False
        with self._lock:
            if len(self._good) > 256:
                self._good.clear()
            self._good.add(digest)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNAUTHENTICATED:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
        if await self._ok(header):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"www-authenticate", b'Basic realm="trainwatch"'),
                    (b"content-type", b"text/plain; charset=utf-8"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b"Unauthorized\n"})
