"""--web-config as Prometheus exporters do it: the daemon serves TLS with client
certificates and basic authentication from an exporter-toolkit web config, and the real
Prometheus scrapes it with its own ``tls_config`` and ``basic_auth``; a wrong password or
a missing client certificate is refused, by the daemon and therefore in ``up``."""

from __future__ import annotations

import base64
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.e2e import DaemonProc, wait_for
from tests.support.skips import requires

PASSWORD = "scrape-s3cret"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _pki(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it."""
    p = {n: d / n for n in ("ca.key", "ca.crt", "server.key", "server.crt", "client.key", "client.crt")}
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=trainwatch test CA",
             "-keyout", str(p["ca.key"]), "-out", str(p["ca.crt"]))  # fmt: skip
    for who, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        csr = d / f"{who}.csr"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
                 "-keyout", str(p[f"{who}.key"]), "-out", str(csr))  # fmt: skip
        (d / f"{who}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(p["ca.crt"]), "-CAkey", str(p["ca.key"]),
                 "-CAcreateserial", "-days", "2", "-extfile", str(d / f"{who}.ext"),
                 "-out", str(p[f"{who}.crt"]))  # fmt: skip
    return p


def _get(url: str, ctx: ssl.SSLContext, password: str | None) -> tuple[int, str, dict[str, str]]:
    headers = {}
    if password is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode()
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=10, context=ctx
        ) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


@requires("prometheus")
def test_tls_with_client_certificates_and_basic_auth_scraped_by_the_real_prometheus(tmp_path):
    import bcrypt

    from tests.support.prom import PrometheusServer

    pki = _pki(tmp_path)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        "tls_server_config:\n"
        "  cert_file: server.crt\n"  # relative to the web config, as the toolkit reads it
        "  key_file: server.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n"
        "  client_ca_file: ca.crt\n"
        "  min_version: TLS12\n"
        "basic_auth_users:\n"
        f"  prometheus: '{hashed}'\n"
    )
    with DaemonProc(tmp_path, "--web-config", str(web)) as daemon:
        assert daemon.base.startswith("https://127.0.0.1:"), daemon.base
        assert "basic auth for 1 user(s), /healthz open" in daemon.log()
        url = daemon.base
        with_cert = ssl.create_default_context(cafile=str(pki["ca.crt"]))
        with_cert.load_cert_chain(str(pki["client.crt"]), str(pki["client.key"]))
        no_cert = ssl.create_default_context(cafile=str(pki["ca.crt"]))
        status, body, _ = _get(url + "/metrics", with_cert, PASSWORD)
        assert status == 200 and "trainwatch_build_info" in body
        status, _, headers = _get(url + "/metrics", with_cert, None)
        assert status == 401 and headers.get("www-authenticate", headers.get("WWW-Authenticate")) == (
            'Basic realm="trainwatch"'
        )
        assert _get(url + "/metrics", with_cert, "wrong")[0] == 401
        assert _get(url + "/postmortems", with_cert, "wrong")[0] == 401
        assert _get(url + "/healthz", with_cert, None)[0] == 200  # probes carry no credentials
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            _get(url + "/healthz", no_cert, PASSWORD)  # no client certificate: no TLS session
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url.replace("https", "http") + "/healthz", timeout=10)

        target = f"127.0.0.1:{daemon.port}"
        tls = {
            "ca_file": str(pki["ca.crt"]),
            "cert_file": str(pki["client.crt"]),
            "key_file": str(pki["client.key"]),
        }

        def job(name: str, tls_config: dict[str, str], password: str) -> dict[str, object]:
            return {
                "job_name": name,
                "scheme": "https",
                "scrape_interval": "1s",
                "tls_config": tls_config,
                "basic_auth": {"username": "prometheus", "password": password},
                "static_configs": [{"targets": [target]}],
            }

        scrapes = [
            job("good", tls, PASSWORD),
            job("wrong-password", tls, "wrong"),
            job("no-client-cert", {"ca_file": str(pki["ca.crt"])}, PASSWORD),
        ]
        with PrometheusServer(tmp_path, scrape_configs=scrapes) as prom:

            def ups() -> dict[str, float] | None:
                got = {
                    r["metric"]["job"]: float(r["value"][1]) for r in prom.api("query", query="up")["result"]
                }
                return got if len(got) == 3 else None

            up = wait_for(ups, 60, "three scrape jobs to report up")
            assert up == {"good": 1.0, "wrong-password": 0.0, "no-client-cert": 0.0}, up
            built = prom.api("query", query="trainwatch_build_info")["result"]
            assert [r["metric"]["job"] for r in built] == ["good"], built
            # the refused scrapes are counted, as Prometheus sees them through the good one
            failures = wait_for(
                lambda: [
                    r for r in prom.api("query", query="trainwatch_http_auth_failures_total > 2")["result"]
                ],
                30,
                "the wrong-password scrapes counted",
                0.5,
            )
            assert [r["metric"]["job"] for r in failures] == ["good"], failures
            reload_ok = prom.api("query", query="trainwatch_web_config_last_reload_successful")["result"]
            assert [r["value"][1] for r in reload_ok] == ["1"], reload_ok
        assert daemon.stop() == 0


def test_story_reads_a_node_behind_tls_client_certificates_and_basic_auth(tmp_path: Path) -> None:
    """``trainwatch story`` reaches a real daemon locked as its web config says (TLS, a
    client certificate, basic auth) with ``--peer-config``, Prometheus's scrape fields
    copied; without it the node is a gap that says why, and the story still comes."""
    import json
    import shutil
    import sys

    import bcrypt

    from tests.support.e2e import REPO
    from tests.support.storyfakes import FIXTURES, PromAnswers, recorded, server

    pki = _pki(tmp_path)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"
        f"basic_auth_users:\n  prometheus: '{hashed}'\n"
    )
    seen = recorded("two-nodes-seen.json")
    first = next(i for i, n in seen.nodes.items() if n.docs[0]["killer"]["kind"] == "cgroup_oom")
    (doc,) = seen.nodes[first].docs
    pm_dir = tmp_path / "postmortems"  # the daemon finds the recorded node's postmortem at start
    pm_dir.mkdir()
    (pm_dir / f"{doc['id']}.json").write_text(json.dumps(doc))
    assert (FIXTURES / "README.md").exists()
    idle = subprocess.Popen(["sleep", "300"])
    try:
        with DaemonProc(tmp_path, "--pid", str(idle.pid), "--web-config", str(web)) as daemon:
            other = next(i for i in seen.nodes if i != first)
            with server(lambda h: h.send_error(404)) as gone:
                prom = PromAnswers.from_seen(seen, {first: daemon.base, other: gone})
                with server(prom.handle) as prom_url:
                    peers = tmp_path / "peers.yml"
                    peers.write_text(
                        f"basic_auth: {{username: prometheus, password: {PASSWORD}}}\n"
                        f"tls_config: {{ca_file: {pki['ca.crt']}, cert_file: {pki['client.crt']}, "
                        f"key_file: {pki['client.key']}}}\n"
                    )

                    def story(*extra: str) -> dict:
                        out = subprocess.run(
                            [sys.executable, "-m", "sidecar", "story", "--prometheus", prom_url, "--job",
                             seen.job, "--format", "json", *extra],
                            capture_output=True, text=True, timeout=60, cwd=REPO,
                        )  # fmt: skip
                        assert out.returncode == 0, out.stderr
                        return dict(json.loads(out.stdout))

                    inst = daemon.base.removeprefix("https://")
                    with_creds = story("--peer-config", str(peers))
                    nodes = {n["instance"]: n for n in with_creds["nodes"]}
                    assert nodes[inst]["reachable"] and nodes[inst]["postmortems"] == [doc["id"]]
                    assert with_creds["first_death"]["killer"] == doc["killer"]
                    without = story()
                    nodes = {n["instance"]: n for n in without["nodes"]}
                    assert not nodes[inst]["reachable"] and "TLS" in nodes[inst]["error"], nodes[inst]
                    assert without["first_death"]["killer"]["confidence"] is None  # Prometheus's label only
                    # a certificate but no password: refused by basic auth, and said so
                    (tmp_path / "cert-only.yml").write_text(peers.read_text().split("\n", 1)[1])
                    cert_only = story("--peer-config", str(tmp_path / "cert-only.yml"))
                    assert (
                        "credentials refused" in {n["instance"]: n for n in cert_only["nodes"]}[inst]["error"]
                    )
    finally:
        idle.kill()
        idle.wait()
        shutil.rmtree(pm_dir, ignore_errors=True)
