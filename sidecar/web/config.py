"""``--web-config FILE``: TLS, basic authentication, response headers and a rate limit for
the HTTP server, in the format of the Prometheus exporter toolkit (its ``web/tls_config.go``
and ``web/handler.go``), so the files node_exporter users keep work here, with the same
meaning. Every key the toolkit reads is honoured with its semantics, or refused at start
with one line naming the key where Python's ``ssl`` or uvicorn cannot honour it; an
unknown key is refused. Nothing is ignored: an endpoint is never less locked down than its
file says.

    tls_server_config:
      cert_file: server.crt            # or cert: inline PEM; relative paths: to this file
      key_file: server.key             # or key: inline PEM
      client_auth_type: RequireAndVerifyClientCert   # NoClientCert (default), VerifyClientCertIfGiven
      client_ca_file: ca.crt           # or client_ca: inline PEM; none: the system's CAs (as Go)
      client_allowed_sans: [prometheus.example]      # the client certificate must carry one
      min_version: TLS12               # TLS10..TLS13 (default TLS12); max_version (default TLS13)
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # Go's names; TLS 1.2 and older
      curve_preferences: [X25519]      # one curve (Python's ssl sets one); CurveP256/384/521, X25519
      prefer_server_cipher_suites: true
    http_server_config:
      http2: false                     # uvicorn speaks HTTP/1.1: true is refused
      headers: {X-Frame-Options: deny, Strict-Transport-Security: max-age=31536000}
    rate_limit: {interval: 1s, burst: 10}
    basic_auth_users:
      prometheus: $2y$10$...           # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')

Where this differs from the toolkit, it refuses rather than serve otherwise:
``RequestClientCert`` and ``RequireAnyClientCert`` accept a client certificate without
verifying it, which Python's ``ssl`` cannot do; a list of several curves needs a Python
whose ``ssl`` sets groups; ``http2: true`` needs an HTTP/2 server. The server reads the file
again when it or a file it names changes (``guard.py``). Needs PyYAML and bcrypt,
the ``web`` extra (``pip install '.[web]'`` from a clone, or the wheel with ``[web]``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.errors import ConfigError
from sidecar.units import go_duration

__all__ = ["CLIENT_AUTH", "VERSIONS", "WebConfig", "load"]

CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# accepted by the toolkit, refused here: each would take a certificate nobody verified
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's secure cipher suites (tls.CipherSuites()) by their names, as OpenSSL names them; the
# TLS 1.3 ones are always on in both (neither Go nor Python configures them): None
CIPHERS: dict[str, str | None] = {
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
}
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}
# the toolkit's headers (handler.go extraHTTPHeaders): the name, and its allowed values (any: ())
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
KEYS = {
    "": {"tls_server_config", "http_server_config", "rate_limit", "basic_auth_users"},
    "tls_server_config": {
        "cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
        "cipher_suites", "curve_preferences", "min_version", "max_version", "prefer_server_cipher_suites",
        "client_allowed_sans",
    },
    "http_server_config": {"http2", "headers"},
    "rate_limit": {"burst", "interval"},
}  # fmt: skip


@dataclass(frozen=True)
class WebConfig:
    path: str
    tls: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    cert_pem: str | None = None  # inline
    key_pem: str | None = None
    client_ca_file: str | None = None
    client_ca_pem: str | None = None
    client_auth: str = "NoClientCert"
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    ciphers: tuple[str, ...] = ()  # OpenSSL names (TLS 1.2 and older)
    curve: str | None = None
    prefer_server_ciphers: bool = True
    allowed_sans: frozenset[str] | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    rate_interval: float = 0.0  # seconds between tokens; 0: no limit
    rate_burst: int = 0
    files: tuple[str, ...] = ()  # every file it reads: a change to any is a change to the config

    def ssl_context(self) -> ssl.SSLContext:
        """A new server context with everything the file says about TLS."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = VERSIONS[self.min_version]
        ctx.maximum_version = VERSIONS[self.max_version]
        _load_pair(ctx, self.cert_file, self.cert_pem, self.key_file, self.key_pem)
        if self.ciphers:
            ctx.set_ciphers(":".join(self.ciphers))
        if self.curve:
            ctx.set_ecdh_curve(self.curve)
        if self.prefer_server_ciphers:
            ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        else:
            ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
        ctx.verify_mode = CLIENT_AUTH[self.client_auth]
        if self.client_ca_file:
            ctx.load_verify_locations(cafile=self.client_ca_file)
        elif self.client_ca_pem:
            ctx.load_verify_locations(cadata=self.client_ca_pem)
        elif ctx.verify_mode != ssl.CERT_NONE:
            ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)  # Go: no ClientCAs, the system's roots
        return ctx

    def san_allowed(self, cert: dict[str, Any] | None) -> bool:
        """Whether a verified client certificate carries one of ``client_allowed_sans``
        (DNS names, emails, IP addresses, URIs, compared as the toolkit does)."""
        if self.allowed_sans is None:
            return True
        for kind, value in (cert or {}).get("subjectAltName", ()):
            if kind == "IP Address":
                try:
                    value = ipaddress.ip_address(value.strip()).compressed
                except ValueError:
                    continue
            if value in self.allowed_sans:
                return True
        return False


def _load_pair(
    ctx: ssl.SSLContext,
    cert_file: str | None,
    cert_pem: str | None,
    key_file: str | None,
    key_pem: str | None,
) -> None:
    """The certificate and key, from files or inline PEM (written to a private temporary
    directory for OpenSSL to read, then removed)."""
    if cert_pem is None and key_pem is None:
        ctx.load_cert_chain(str(cert_file), key_file)
        return
    with tempfile.TemporaryDirectory(prefix="trainwatch-tls-") as d:
        os.chmod(d, 0o700)

        def put(name: str, text: str) -> str:
            p = os.path.join(d, name)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return p

        ctx.load_cert_chain(
            put("cert.pem", cert_pem) if cert_pem is not None else str(cert_file),
            put("key.pem", key_pem) if key_pem is not None else key_file,
        )


def _duration(value: Any, fail: Callable[[str], ConfigError]) -> float:
    """A Go duration as YAML gives it: ``1s``, ``500ms``, ``1m30s``, or 0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value / 1e9  # Go reads a bare number as nanoseconds
    if isinstance(value, str):
        seconds = 0.0 if value.strip() == "0" else go_duration(value.strip())
        if seconds is not None:
            return seconds
    raise fail(f"rate_limit.interval: expected a duration (1s, 500ms), got {value!r}")


def load(path: str) -> WebConfig:
    """Read and check the file; ConfigError names what is wrong (the daemon refuses to
    start rather than serve without the protection it was asked for)."""
    try:
        import bcrypt  # noqa: F401  (checked here: a web config without it cannot work)
        import yaml
    except ImportError as exc:
        raise ConfigError(
            f"--web-config needs PyYAML and bcrypt, the web extra of trainwatchd (no {exc.name})"
        ) from None

    def fail(why: str) -> ConfigError:
        return ConfigError(f"--web-config: {path}: {why}")

    try:
        with open(path, encoding="utf-8") as f:
            doc: Any = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--web-config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise fail(f"not valid YAML: {' '.join(str(exc).split())[:200]}") from None
    doc = doc or {}
    if not isinstance(doc, dict):
        raise fail("expected a mapping at the top")
    for section, known in KEYS.items():
        part = doc if not section else doc.get(section) or {}
        if not isinstance(part, dict):
            raise fail(f"{section} must be a mapping")
        unknown = sorted(str(k) for k in set(part) - known)
        if unknown:
            prefix = f"{section}." if section else ""
            raise fail(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(known))})")
    base = os.path.dirname(os.path.abspath(path))
    tls_doc: dict[str, Any] = doc.get("tls_server_config") or {}
    files: list[str] = [os.path.abspath(path)]

    def given(key: str) -> str | None:
        v = tls_doc.get(key)
        if v is None or v == "":
            return None
        if not isinstance(v, str):
            raise fail(f"tls_server_config.{key} must be a string")
        return v

    def where(key: str) -> str | None:
        p = given(key)
        if p is None:
            return None
        full = p if os.path.isabs(p) else os.path.join(base, p)
        if not os.path.exists(full) or os.path.isdir(full):
            raise fail(f"tls_server_config.{key}: {full}: no such file")
        files.append(full)
        return full

    enabled = any(given(k) for k in ("cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file",
                                     "client_auth_type"))  # fmt: skip
    settings: dict[str, Any] = {}
    if enabled:
        if given("cert_file") is None and given("cert") is None:
            raise fail("tls_server_config: missing one of cert or cert_file")
        if given("key_file") is None and given("key") is None:
            raise fail("tls_server_config: missing one of key or key_file")
        settings.update(
            tls=True,
            cert_file=where("cert_file"),
            key_file=where("key_file"),
            cert_pem=None if given("cert_file") else given("cert"),
            key_pem=None if given("key_file") else given("key"),
            client_ca_file=where("client_ca_file"),
            client_ca_pem=None if given("client_ca_file") else given("client_ca"),
        )
        settings.update(_tls_policy(tls_doc, settings, fail))
    users = _users(doc.get("basic_auth_users"), fail)
    http_doc: dict[str, Any] = doc.get("http_server_config") or {}
    if http_doc.get("http2") is True:
        raise fail("http_server_config.http2: true cannot be honoured: the server (uvicorn) speaks "
                   "HTTP/1.1 only; remove it or set false")  # fmt: skip
    if "http2" in http_doc and not isinstance(http_doc["http2"], bool):
        raise fail("http_server_config.http2 must be true or false")
    headers = http_doc.get("headers") or {}
    if not isinstance(headers, dict):
        raise fail("http_server_config.headers must be a mapping")
    for name, value in headers.items():
        if name not in HEADERS:
            raise fail(f'http_server_config.headers: HTTP header "{name}" can not be configured '
                       f"(these can: {', '.join(HEADERS)})")  # fmt: skip
        if HEADERS[name] and value not in HEADERS[name]:
            raise fail(f"http_server_config.headers: invalid value for {name}: expected one of "
                       f"{', '.join(HEADERS[name])}, got {value!r}")  # fmt: skip
    rate = doc.get("rate_limit") or {}
    burst = rate.get("burst", 0)
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 0:
        raise fail("rate_limit.burst must be a whole number, 0 or more")
    cfg = WebConfig(
        path,
        users=users,
        headers={str(k): str(v) for k, v in headers.items()},
        rate_interval=_duration(rate.get("interval", 0), fail),
        rate_burst=burst,
        files=tuple(files),
        **settings,
    )
    if cfg.tls:
        try:
            cfg.ssl_context()
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise fail(
                f"tls_server_config: the certificate, key or client CA cannot be used: {exc}"
            ) from None
    return cfg


def _tls_policy(
    tls_doc: dict[str, Any], files: dict[str, Any], fail: Callable[[str], ConfigError]
) -> dict[str, Any]:
    """Client certificates, versions, ciphers and curves, checked as the toolkit checks them."""
    client_auth = tls_doc.get("client_auth_type") or "NoClientCert"
    if client_auth in UNVERIFIED_CLIENT_AUTH:
        raise fail(f"tls_server_config.client_auth_type {client_auth} cannot be honoured: it accepts a "
                   "client certificate nobody verified, which Python's ssl does not do; use "
                   "RequireAndVerifyClientCert with client_ca_file")  # fmt: skip
    if client_auth not in CLIENT_AUTH:
        raise fail(f"tls_server_config.client_auth_type: invalid ClientAuth {client_auth!r} (one of "
                   f"{', '.join(CLIENT_AUTH)})")  # fmt: skip
    has_ca = files.get("client_ca_file") or files.get("client_ca_pem")
    if has_ca and client_auth == "NoClientCert":
        raise fail("tls_server_config: client CA's have been configured without a Client Auth Policy "
                   "(client_auth_type)")  # fmt: skip
    out: dict[str, Any] = {"client_auth": client_auth}
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = tls_doc.get(key) or default
        if v not in VERSIONS:
            raise fail(f"tls_server_config.{key}: unknown TLS version {v!r} (one of {', '.join(VERSIONS)})")
        out[key] = v
    if VERSIONS[out["min_version"]] > VERSIONS[out["max_version"]]:
        raise fail("tls_server_config: min_version is above max_version")
    ciphers = tls_doc.get("cipher_suites") or []
    if not isinstance(ciphers, list):
        raise fail("tls_server_config.cipher_suites must be a list")
    for c in ciphers:
        if c not in CIPHERS:
            raise fail(f"tls_server_config.cipher_suites: unknown cipher {c!r}")
    out["ciphers"] = tuple(name for c in ciphers if (name := CIPHERS[c]) is not None)
    if ciphers and not out["ciphers"] and out["min_version"] != "TLS13":
        raise fail("tls_server_config.cipher_suites: only TLS 1.3 suites, which are always on; "
                   "name TLS 1.2 suites or set min_version TLS13")  # fmt: skip
    curves = tls_doc.get("curve_preferences") or []
    if not isinstance(curves, list):
        raise fail("tls_server_config.curve_preferences must be a list")
    for c in curves:
        if c not in CURVES:
            raise fail(f"tls_server_config.curve_preferences: unknown curve {c!r}")
    if len(curves) > 1:
        raise fail("tls_server_config.curve_preferences: several curves cannot be honoured: this "
                   "Python's ssl sets one curve (set_ecdh_curve); name one")  # fmt: skip
    out["curve"] = CURVES[curves[0]] if curves else None
    prefer = tls_doc.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise fail("tls_server_config.prefer_server_cipher_suites must be true or false")
    out["prefer_server_ciphers"] = prefer
    sans = tls_doc.get("client_allowed_sans")
    if sans is not None:
        if not isinstance(sans, list) or not all(isinstance(s, str) for s in sans):
            raise fail("tls_server_config.client_allowed_sans must be a list of names")
        if client_auth == "NoClientCert":
            raise fail("tls_server_config.client_allowed_sans needs client_auth_type "
                       "RequireAndVerifyClientCert (or VerifyClientCertIfGiven)")  # fmt: skip
        out["allowed_sans"] = frozenset(_san(s) for s in sans)
    return out


def _san(value: str) -> str:
    try:
        return ipaddress.ip_address(value).compressed
    except ValueError:
        return value


def _users(users_doc: Any, fail: Callable[[str], ConfigError]) -> dict[str, bytes]:
    users_doc = users_doc or {}
    if not isinstance(users_doc, dict):
        raise fail("basic_auth_users must be a mapping of user: bcrypt hash")
    users = {}
    for user, hashed in users_doc.items():
        if not isinstance(hashed, str) or not re.fullmatch(
            r"\$2[abxy]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}", hashed
        ):
            raise fail(f"basic_auth_users.{user}: expected a bcrypt hash ($2y$10$ and 53 characters)")
        users[str(user)] = hashed.encode()
    return users
