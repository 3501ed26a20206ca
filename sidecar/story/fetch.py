"""Bounded HTTP GETs of JSON for ``trainwatch story``: Prometheus's API and each node's
daemon. Every answer comes from outside this process (a Prometheus, another node's daemon,
whatever listens at a scraped address), so each GET has one deadline for the whole exchange
(connect, headers and body: a server that drips a byte a second is cut off), a size limit,
and a one-line error; nothing here follows redirects or runs what it reads.

The credentials for the nodes' daemons (``--peer-config FILE``) use the HTTP client fields
of Prometheus's own scrape configuration, so the block that lets Prometheus scrape the
daemons (their ``--web-config``) is copied as is::

    basic_auth: {username: story, password_file: /etc/trainwatch/story.pass}
    tls_config: {ca_file: ca.crt, cert_file: client.crt, key_file: client.key,
                 server_name: node-1, insecure_skip_verify: false}
    prometheus:              # optional: the same two keys for the Prometheus API
      basic_auth: {username: ..., password: ...}

Relative paths are relative to the file.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from sidecar.errors import ConfigError

__all__ = ["ClientConfig", "FetchError", "PeerConfig", "get_json", "load_peer_config"]

_CHUNK = 1 << 16
_HEADERS_LIMIT = 100  # http.client's own limit on header lines


class FetchError(Exception):
    """One line: what could not be fetched, and why."""


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How to reach one kind of server: basic auth and TLS (Prometheus's client fields)."""

    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None
    insecure_skip_verify: bool = False

    def headers(self) -> dict[str, str]:
        if self.username is None:
            return {}
        pair = f"{self.username}:{self.password or ''}".encode()
        return {"Authorization": "Basic " + base64.b64encode(pair).decode()}

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def __repr__(self) -> str:  # never print a password
        return f"ClientConfig(username={self.username!r}, ca_file={self.ca_file!r}, cert={self.cert_file!r})"


@dataclass(frozen=True, slots=True)
class PeerConfig:
    nodes: ClientConfig = ClientConfig()
    prometheus: ClientConfig = ClientConfig()


_CLIENT_KEYS = frozenset({"basic_auth", "tls_config"})
_AUTH_KEYS = frozenset({"username", "password", "password_file"})
_TLS_KEYS = frozenset({"ca_file", "cert_file", "key_file", "server_name", "insecure_skip_verify"})


def _client(section: Any, where: str, base: str) -> ClientConfig:
    if section is None:
        return ClientConfig()
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: must be a mapping")
    unknown = set(section) - _CLIENT_KEYS - ({"prometheus"} if where == "peer config" else set())
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: basic_auth, tls_config)")

    def path(value: Any, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: {key} must be a file path")
        full = value if os.path.isabs(value) else os.path.join(base, value)
        if not os.path.isfile(full):
            raise ConfigError(f"{where}: {key} {full}: no such file")
        return full

    auth = section.get("basic_auth") or {}
    tls = section.get("tls_config") or {}
    if not isinstance(auth, dict) or not isinstance(tls, dict):
        raise ConfigError(f"{where}: basic_auth and tls_config must be mappings")
    for name, keys, given in (("basic_auth", _AUTH_KEYS, auth), ("tls_config", _TLS_KEYS, tls)):
        bad = set(given) - keys
        if bad:
            raise ConfigError(f"{where}: {name}: unknown key {sorted(bad)[0]!r}")
    username = auth.get("username")
    if auth and not isinstance(username, str):
        raise ConfigError(f"{where}: basic_auth.username must be a string")
    password = auth.get("password")
    if "password_file" in auth:
        with open(path(auth["password_file"], "basic_auth.password_file"), encoding="utf-8") as f:
            password = f.read().strip()
    if password is not None and not isinstance(password, str):
        raise ConfigError(f"{where}: basic_auth.password must be a string")
    skip = tls.get("insecure_skip_verify", False)
    if not isinstance(skip, bool):
        raise ConfigError(f"{where}: tls_config.insecure_skip_verify must be true or false")
    server_name = tls.get("server_name")
    if server_name is not None and not isinstance(server_name, str):
        raise ConfigError(f"{where}: tls_config.server_name must be a string")
    if ("cert_file" in tls) != ("key_file" in tls):
        raise ConfigError(f"{where}: tls_config needs both cert_file and key_file, or neither")
    config = ClientConfig(
        username=username,
        password=password,
        ca_file=path(tls["ca_file"], "tls_config.ca_file") if "ca_file" in tls else None,
        cert_file=path(tls["cert_file"], "tls_config.cert_file") if "cert_file" in tls else None,
        key_file=path(tls["key_file"], "tls_config.key_file") if "key_file" in tls else None,
        server_name=server_name,
        insecure_skip_verify=skip,
    )
    try:
        config.context()  # a bad certificate or key fails now, with its name, not at the first node
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{where}: tls_config: {exc}") from None
    return config


def load_peer_config(path: str | None) -> PeerConfig:
    """The ``--peer-config`` file, checked whole at start (a ConfigError names the key)."""
    if path is None:
        return PeerConfig()
    try:
        import yaml
    except ImportError:  # pragma: no cover - the web extra
        raise ConfigError("--peer-config needs PyYAML, the web extra of trainwatchd") from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--peer-config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--peer-config {path}: not YAML: {str(exc).splitlines()[0]}") from None
    base = os.path.dirname(os.path.abspath(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--peer-config {path}: must be a mapping")
    return PeerConfig(
        nodes=_client(data, "peer config", base),
        prometheus=_client(data.get("prometheus"), "peer config: prometheus", base),
    )


def get_json(url: str, *, timeout: float, limit: int, config: ClientConfig | None = None) -> Any:
    """GET ``url`` and parse its JSON body: connected within ``timeout`` seconds, then the
    whole exchange (request, headers, body) within ``timeout`` more, at most ``limit``
    bytes; FetchError (one line) for anything else: refused, timed out, not 200, too big,
    not JSON, too deeply nested."""
    config = config or ClientConfig()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"{url}: not an http(s) URL")
    try:
        port = parts.port
    except ValueError:
        raise FetchError(f"{url}: bad port") from None
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        try:
            ctx = config.context()
        except (ssl.SSLError, OSError) as exc:
            raise FetchError(f"{url}: TLS: {exc}") from None
        conn = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    expired = threading.Event()

    def expire() -> None:  # the deadline: whatever read blocks ends now (a drip of headers too)
        expired.set()
        with contextlib.suppress(OSError):
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    try:
        if parts.scheme == "https" and config.server_name:
            # SNI and verification against server_name, while connecting to the scraped address
            conn.connect = _connect_with_name(conn, config, timeout)  # type: ignore[method-assign]
        conn.connect()
        timer.start()
        conn.request("GET", target, headers={"Accept": "application/json", **config.headers()})
        resp = conn.getresponse()
        body = bytearray()
        while not expired.is_set():
            chunk = resp.read1(_CHUNK)
            if not chunk:
                break
            body += chunk
            if len(body) > limit:
                raise FetchError(f"{url}: answer larger than {limit >> 20} MiB; not read")
        if expired.is_set():
            raise TimeoutError
        status = resp.status
    except FetchError:
        raise
    except (TimeoutError, OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise FetchError(f"{url}: no complete answer within {timeout:g} s") from None
        if isinstance(exc, ssl.SSLError):
            raise FetchError(f"{url}: TLS: {exc.reason or exc}") from None
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise FetchError(f"{url}: {reason}") from None
    finally:
        timer.cancel()
        conn.close()
    if status == 401:
        raise FetchError(f"{url}: HTTP 401: credentials refused (--peer-config)")
    if status != 200:
        raise FetchError(f"{url}: HTTP {status}: {_snippet(bytes(body))}")
    try:
        return json.loads(bytes(body))
    except RecursionError:
        raise FetchError(f"{url}: JSON nested too deeply") from None
    except ValueError:
        raise FetchError(f"{url}: not JSON: {_snippet(bytes(body))}") from None


def _connect_with_name(conn: http.client.HTTPConnection, config: ClientConfig, timeout: float) -> Any:
    def connect() -> None:
        raw = socket.create_connection((conn.host, conn.port), timeout)
        conn.sock = config.context().wrap_socket(raw, server_hostname=config.server_name)

    return connect


def _snippet(body: bytes) -> str:
    text = body[:120].decode("utf-8", "replace")
    return " ".join(text.split()) or "(empty)"
