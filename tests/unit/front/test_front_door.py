"""The front door keeps its promises: every verb's --help prints usage and exits 0 starting
nothing, ``trainwatch`` alone lists the verbs, the options are declared once (parser,
variables, help defaults and docs/options.md agree), the generated pages are current, the man
page and completions come from the parsers, the client verbs honour TRAINWATCH_PORT, doctor
checks the options it is given, and the catalog is whole or says it is not."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sidecar.errors import ConfigError
from sidecar.front import cli
from sidecar.front.manual import render_options
from sidecar.front.options import OPTIONS
from sidecar.front.verbs import VERBS, parser_for
from tests.support.e2e import REPO, free_port

VERB_NAMES = [v.name for v in VERBS if v.name]


def _trainwatch(
    *args: str, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=dict(os.environ, **(env or {})),
    )


@pytest.mark.parametrize("verb", ["", *VERB_NAMES])
def test_every_verb_has_help_that_exits_0(verb):
    r = _trainwatch(*([verb] if verb else []), "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: trainwatch {verb}".rstrip()), r.stdout[:200]
    assert not r.stderr


@pytest.mark.parametrize("verb", ["", *VERB_NAMES])
def test_help_starts_nothing(verb, monkeypatch, capsys):
    """In the process: --help returns before the verb's code is imported or anything runs (no
    subprocess, no thread, no socket, no cgroup)."""
    import socket

    def refuse(*a, **k):
        raise AssertionError("--help started something")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    monkeypatch.setattr(socket.socket, "bind", refuse)
    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(SystemExit) as exit_:
        cli.main([*([verb] if verb else []), "--help"], environ={})
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: trainwatch")


def test_trainwatch_alone_lists_the_verbs():
    r = _trainwatch()
    assert r.returncode == 0 and not r.stderr
    for name in VERB_NAMES:
        assert f"trainwatch {name} " in r.stdout
    assert "trainwatch --attach-torchrun" in r.stdout
    assert _trainwatch("help").stdout == r.stdout
    assert _trainwatch("help", "diagnose").stdout.startswith("usage: trainwatch diagnose")


def test_an_unknown_verb_is_one_line_and_exit_2():
    r = _trainwatch("diagnos", "x.log")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown verb 'diagnos'" in r.stderr


def test_help_shows_each_options_default_and_variable():
    """One declaration: each option's flag is in the parser of every verb the table names,
    with its default and its variable in the help text, and nowhere else."""
    for o in OPTIONS:
        for v in VERBS:
            verb = v.name or "daemon"
            text = " ".join(v.parser().format_help().split())
            if o.flag is None:
                continue
            if verb in o.verbs:
                assert o.flag in text and o.var in text, (verb, o.flag)
                assert " ".join(f"default {o.default}".split()) in text, (verb, o.flag)
            else:
                flags = {f for a in v.parser()._actions for f in a.option_strings}
                assert o.flag not in flags or verb in ("postmortem", "story"), (verb, o.flag)


def test_every_variable_of_the_table_reaches_the_settings():
    """The variable of each option gives the same Settings as its flag."""
    from sidecar.front.options import settings_from

    samples = {
        "--pid": "7",
        "--interval": "0.5",
        "--host": "::1",
        "--port": "9000",
        "--postmortem-dir": "/tmp/pm-x",
        "--history": "120",
        "--log-level": "debug",
        "--stall-after": "90",
        "--disable": "kmsg",
        "--web-config": "/etc/w.yml",
        "--prometheus": "http://prom:9090",
        "--oom-score-adj": "-500",
    }
    for o in OPTIONS:
        if o.flag not in samples:
            continue
        for verb in o.verbs:
            p = parser_for("" if verb == "daemon" else verb)
            head = ["--attach-torchrun"] if verb == "daemon" else []
            by_flag = settings_from(p.parse_args([*head, o.flag, samples[o.flag]]), {}, verb)
            env = {o.var: samples[o.flag], **({"TRAINWATCH_ATTACH_TORCHRUN": "1"} if head else {})}
            by_var = settings_from(p.parse_args([]), env, verb)
            assert by_flag == by_var, (verb, o.flag)


def test_docs_options_is_generated_from_the_table():
    page = (REPO / "docs" / "options.md").read_text()
    stale = "docs/options.md is stale: python -m sidecar.front.manual --options > docs/options.md"
    assert page == render_options(), stale
    for o in OPTIONS:
        assert o.var in page


def test_docs_metrics_is_generated_from_the_table():
    from sidecar.metrics.table import METRICS, render_metrics

    page = (REPO / "docs" / "metrics.md").read_text()
    assert page == render_metrics(), (
        "docs/metrics.md is stale: python -m sidecar.metrics.table > docs/metrics.md"
    )
    assert all(f"`{name}`" in page for name in METRICS)


def test_the_man_page_and_completions_come_from_the_parsers(tmp_path):
    from sidecar.front.manual import completion, man_page, write

    written = {p.name for p in write(tmp_path)}
    assert written == {"trainwatch.1", "trainwatch.bash", "_trainwatch"}
    page, bash, zsh = man_page(), completion("bash"), completion("zsh")
    for v in VERBS:
        for action in v.parser()._actions:
            for flag in action.option_strings:
                assert flag.replace("-", "\\-") in page, flag
                assert flag in bash and flag in zsh, flag
        if v.name:
            assert v.name in bash and f"'{v.name}:" in zsh
    r = subprocess.run(["bash", "-n", str(tmp_path / "trainwatch.bash")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with pytest.raises(ValueError):
        completion("fish")


def test_bash_completes_verbs_and_a_verbs_values(tmp_path):
    """The generated script, sourced in a real bash, completes as a user would see."""
    from sidecar.front.manual import completion

    script = tmp_path / "c.bash"
    script.write_text(completion("bash"))

    def complete(*words: str) -> list[str]:
        line = " ".join(f"'{w}'" for w in words)
        r = subprocess.run(
            ["bash", "-c", f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
             '_trainwatch; printf "%s\\n" "${COMPREPLY[@]}"'],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert "diagnose" in complete("trainwatch", "dia")
    assert complete("trainwatch", "diagnose", "--format", "") == ["text", "json", "html"]
    assert "--strict" in complete("trainwatch", "doctor", "--st")
    assert "--interval" in complete("trainwatch", "--attach-torchrun", "--int")


def test_the_completion_verb_prints_the_script():
    r = _trainwatch("completion", "bash")
    assert r.returncode == 0 and "complete -o default -F _trainwatch trainwatch" in r.stdout
    assert _trainwatch("completion", "fish").returncode == 2


class _OnePostmortem(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/postmortem" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body if self.path == "/postmortem" else b"{}")

    def log_message(self, *args: object) -> None:
        pass


def test_postmortem_asks_the_daemon_at_trainwatch_port(tmp_path):
    """Without an id and with an empty postmortem directory, `postmortem` asks the local
    daemon at the port the daemon's options give (TRAINWATCH_PORT), not the default."""
    doc = json.loads((REPO / "tests/fixtures/device-h200/cuda-oom.postmortem.json").read_text())
    _OnePostmortem.body = json.dumps(doc).encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OnePostmortem)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = str(server.server_address[1])
        env = {"TRAINWATCH_POSTMORTEM_DIR": str(tmp_path / "empty")}
        r = _trainwatch("postmortem", "--format", "json", env={**env, "TRAINWATCH_PORT": port})
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["id"] == doc["id"]
        assert _trainwatch("postmortem", "--port", port, env=env).returncode == 0
        free = str(free_port())
        r = _trainwatch("postmortem", env={**env, "TRAINWATCH_PORT": free})
        assert r.returncode == 2 and f"127.0.0.1:{free}/postmortem" in r.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_doctor_checks_the_options_it_is_given(tmp_path):
    """doctor reads the daemon's options and variables: a source they turn off is 'off', a
    postmortem directory it cannot write and a web config that does not load are missing,
    and --strict turns what is missing into exit status 1."""
    r = _trainwatch("doctor", "--disable", "kmsg", env={"TRAINWATCH_DISABLE": ""})
    assert r.returncode == 0 and "off      kernel log" in r.stdout
    r = _trainwatch("doctor", env={"TRAINWATCH_DISABLE": "tracepoint"})
    assert "off      signal tracepoint" in r.stdout
    bad = tmp_path / "web.yml"
    bad.write_text("tls_server_config: {cert_file: /nonexistent}\nnonsense_key: 1\n")
    r = _trainwatch("doctor", "--web-config", str(bad))
    assert r.returncode == 0 and "MISSING  web config" in r.stdout
    r = _trainwatch("doctor", "--strict", "--web-config", str(bad))
    assert r.returncode == 1 and "MISSING  web config" in r.stdout
    assert "emitter catalog" in r.stdout and "messages from" in r.stdout


def test_doctor_strict_fails_exactly_when_something_is_missing():
    r = _trainwatch("doctor", "--strict")
    missing = "missing:" in r.stdout.splitlines()[-1]
    assert r.returncode == (1 if missing else 0), r.stdout


def test_the_catalog_files_are_the_folders_and_a_lost_one_is_an_error(tmp_path, monkeypatch):
    import sidecar.catalog as catalog

    folder = REPO / "sidecar" / "catalog"
    assert sorted(p.name for p in folder.glob("*.toml")) == sorted(catalog.FILES)
    broken = tmp_path / "catalog"
    shutil.copytree(folder, broken)
    (broken / "nccl.toml").unlink()
    monkeypatch.setattr(catalog.resources, "files", lambda name: broken)
    with pytest.raises(catalog.CatalogError, match=r"nccl\.toml"):
        catalog.texts()


def test_run_takes_its_settings_from_the_one_table():
    """`run` is parsed by the CLI: its options are the table's, --pid is refused by name."""
    from sidecar.front.options import settings_from

    ns = parser_for("run").parse_args(["--port", "0", "--interval", "0.5"])
    s = settings_from(ns, {"TRAINWATCH_HISTORY": "30"}, "run")
    assert (s.port, s.interval_seconds, s.history_seconds) == (0, 0.5, 30.0)
    for argv in (["run", "--pid", "3", "--", "true"], ["run", "--"], ["run", "true"]):
        with pytest.raises(ConfigError):
            cli._dispatch(list(argv), {})


def test_the_version_is_written_once():
    """sidecar/__init__.py holds it; pyproject reads it from there, and nothing else that
    ships or deploys repeats it (a captured log line in docs/ is history, not a source)."""
    import sidecar

    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "sidecar.__version__"' in pyproject
    assert not re.search(r"^version\s*=\s*[\"']", pyproject, re.M)
    pattern = re.compile(re.escape(sidecar.__version__))
    offenders = []
    for folder in ("sidecar", "deploy", "scripts", "dashboards", ".ci"):
        for path in (REPO / folder).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file() or path.name == "__init__.py":
                continue
            if pattern.search(path.read_text(errors="replace")):
                offenders.append(str(path.relative_to(REPO)))
    for name in ("pyproject.toml", "setup.py", "Makefile", "README.md"):
        if pattern.search((REPO / name).read_text()):
            offenders.append(name)
    assert not offenders, offenders


def test_no_install_line_names_another_projects_package():
    """`trainwatch` and `sidecar` on PyPI are other projects': every pip line in the docs,
    the deployment and the code names this distribution, a path, a wheel or the image."""
    line = re.compile(r"pip3? install[^\n`]*")
    bad = []
    places = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "deploy").rglob("*")]
    places += [*(REPO / "sidecar").rglob("*.py"), REPO / "SECURITY.md", REPO / "CHANGELOG.md"]
    for path in places:
        if not path.is_file():
            continue
        for m in line.finditer(path.read_text(errors="replace")):
            words = re.findall(r"['\"]?([A-Za-z0-9_.\-/$()*\[\]]+)", m.group(0).split("install", 1)[1])
            for w in words:
                w = w.strip("'\"")
                if re.fullmatch(r"(trainwatch|sidecar)(\[.*\])?", w):
                    bad.append(f"{path.relative_to(REPO)}: {m.group(0)}")
    assert not bad, bad
