"""A real Prometheus server (Debian's `prometheus`) on a free loopback port, for tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.support.e2e import REPO, wait_for
from tests.support.ports import free_port

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
DEPLOY = REPO / "deploy" / "prometheus"


class PrometheusServer:
    """Prometheus scraping ``targets`` every second with the shipped scrape job (its
    ``honor_labels`` and all) and the shipped rules, evaluated every second. Each target
    stands for one node's daemon."""

    def __init__(self, tmp: Path, *targets: str, scrape_configs: list[dict[str, Any]] | None = None) -> None:
        """``scrape_configs``: these jobs instead of the shipped one (every second)."""
        assert PROMETHEUS is not None
        shipped = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        (scrape,) = shipped["scrape_configs"]
        scrape["scrape_interval"] = "1s"
        scrape["static_configs"] = [{"targets": list(targets)}]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(DEPLOY / f) for f in shipped["rule_files"]],
            "scrape_configs": scrape_configs if scrape_configs is not None else [scrape],
        }
        self.dir = tmp / "prometheus"
        self.dir.mkdir()
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = open(self.dir / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._ready, 60, "prometheus to be ready", 0.2)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log()}")
        try:
            with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def log(self) -> str:
        return (self.dir / "prometheus.log").read_text()

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>: the ``data`` of a successful answer; AssertionError else."""
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} {params}: HTTP {e.code}: {e.read().decode()[:500]}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[Any]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step)
        return list(data["result"])

    def query(self, expr: str, at: float) -> list[Any]:
        data = self.api("query", query=expr, time=f"{at:.3f}")
        return list(data["result"]) if data["resultType"] == "vector" else [data["result"]]

    def firing(self, alertname: str, **labels: str) -> list[dict[str, Any]]:
        """The firing alerts of that name whose labels include ``labels``."""
        return [
            a
            for a in self.api("alerts")["alerts"]
            if a["state"] == "firing"
            and a["labels"]["alertname"] == alertname
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def target_health(self) -> list[str]:
        return [t["health"] for t in self.api("targets")["activeTargets"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
