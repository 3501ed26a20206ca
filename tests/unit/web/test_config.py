"""The web config file: what the exporter toolkit accepts is read the same way, and every
mistake refuses to start with one line naming it (serving without the protection asked
for would be worse)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys

import bcrypt  # the web extra, a test dependency
import pytest

from sidecar.errors import ConfigError
from sidecar.web.config import load
from sidecar.web.guard import Reloader, WebGuard


def BasicAuth(app, users):  # the guard as these tests knew it: users alone
    from sidecar.web.config import WebConfig

    return WebGuard(app, Reloader(WebConfig("-", users=users)))


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("cert")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=t",
         "-keyout", str(d / "k.pem"), "-out", str(d / "c.pem")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return d


HASH = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("- a list\n", "expected a mapping at the top"),
        ("tls_server_config: {cert_file: c.pem}\n", "missing one of key or key_file"),
        ("tls_server_config: {cert_file: nope.pem, key_file: k.pem}\n", "nope.pem: no such file"),
        (
            "tls_server_config: {cert_file: c.pem, key_file: k.pem, client_auth_type: Maybe}\n",
            "client_auth_type",
        ),
        (
            "tls_server_config: {cert_file: c.pem, key_file: k.pem,\n"
            "  client_auth_type: RequireAnyClientCert}\n",
            "nobody verified",
        ),
        (
            "tls_server_config: {cert_file: c.pem, key_file: k.pem, min_version: SSL3}\n",
            "unknown TLS version",
        ),
        ("tls_server_config: {cert_file: k.pem, key_file: c.pem}\n", "cannot be used"),
        ("basic_auth_users: {alice: plaintext}\n", "basic_auth_users.alice: expected a bcrypt hash"),
        ("basic_auth_user: {}\n", "unknown key basic_auth_user"),
        (
            "tls_server_config: {cert_file: c.pem, key_file: k.pem, cipher_suite: []}\n",
            "unknown key tls_server_config.cipher_suite",
        ),
        ("http_server_config: {http2: true}\n", "http2: true cannot be honoured"),
        ("tls_server_config: [\n", "not valid YAML"),
    ],
)
def test_mistakes_refuse_to_start(cert, text, error):
    path = cert / "web.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="--web-config: ") as info:
        load(str(path))
    assert error in str(info.value)


def test_a_good_config_with_relative_paths(cert):
    path = cert / "web.yml"
    path.write_text(
        f"tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\nbasic_auth_users:\n  bob: '{HASH}'\n"
    )
    cfg = load(str(path))
    assert cfg.tls and cfg.cert_file == str(cert / "c.pem") and set(cfg.users) == {"bob"}
    assert cfg.ssl_context().minimum_version.name == "TLSv1_2"
    with pytest.raises(ConfigError, match="cannot read"):
        load(str(cert / "missing.yml"))


def _call(app: WebGuard, path: str, auth: str | None) -> int:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    headers = [(b"authorization", auth.encode())] if auth is not None else []
    asyncio.run(app({"type": "http", "path": path, "headers": headers}, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_basic_auth_checks_bcrypt_once_per_good_password(monkeypatch):
    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = BasicAuth(ok, {"bob": HASH.encode()})
    good = "Basic " + base64.b64encode(b"bob:pw").decode()
    calls = []
    real = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda p, h: calls.append(p) or real(p, h))
    assert _call(app, "/metrics", good) == 200
    assert _call(app, "/metrics", good) == 200
    assert calls == [b"pw"]  # the second scrape did not pay bcrypt again
    for bad in (None, "Basic " + base64.b64encode(b"bob:no").decode(), "Basic !!!", "Bearer x",
                "Basic " + base64.b64encode(b"eve:pw").decode()):  # fmt: skip
        assert _call(app, "/metrics", bad) == 401, bad
    assert _call(app, "/healthz", None) == 200


def test_a_password_guess_never_blocks_the_event_loop(monkeypatch):
    """bcrypt runs on a worker thread: while a wrong password is being checked, the loop
    keeps serving, so guessing cannot starve scrapes or /healthz. The check here cannot end
    until a coroutine on the loop has run: were it on the loop, that coroutine would never
    run and the check would give up (and the test fail) after 30 s."""
    import threading

    loop_ran = threading.Event()
    real = bcrypt.checkpw

    def slow_check(password: bytes, hashed: bytes) -> bool:
        assert loop_ran.wait(30), "the check ran on the event loop"
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", slow_check)

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    app = BasicAuth(ok, {"bob": HASH.encode()})
    bad = "Basic " + base64.b64encode(b"bob:guess").decode()

    async def main() -> int:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request"}

        async def send(msg: dict) -> None:
            sent.append(msg)

        async def another_request() -> None:
            loop_ran.set()

        scope = {"type": "http", "path": "/metrics", "headers": [(b"authorization", bad.encode())]}
        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.sleep(0)  # the check has started
        await asyncio.create_task(another_request())
        await task
        return sent[0]["status"]

    assert asyncio.run(main()) == 401


def test_the_flag_and_its_variable():
    from sidecar.front.options import parse_args

    assert parse_args(["--attach-torchrun", "--web-config", "w.yml"], {}).web_config.endswith("/w.yml")
    assert (
        parse_args(["--attach-torchrun"], {"TRAINWATCH_WEB_CONFIG": "/etc/w.yml"}).web_config == "/etc/w.yml"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "--attach-torchrun",
            "--port",
            "0",
            "--web-config",
            "/nonexistent/w.yml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--web-config: cannot read /nonexistent/w.yml" in r.stderr, r.stderr
