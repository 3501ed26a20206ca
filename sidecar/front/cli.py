"""The command line: runs the verb that ``verbs.VERBS`` names (the daemon, ``run``,
``diagnose``, ``postmortem``, ``story``, ``doctor``, ``demo``, ``completion``) and is the one
place that turns errors into one-line advice and exit statuses (0 done, 1 failure at run
time, 2 bad usage). The options: ``options.py``; the verbs and their parsers: ``verbs.py``;
the daemon and its HTTP server: ``service.py``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar.errors import ConfigError
from sidecar.front.options import DAEMON, DOCTOR, POSTMORTEM, RUN, STORY, parse_args, settings_from
from sidecar.front.verbs import VERBS, listing, parser_for

__all__ = ["main", "parse_args"]


def daemon_command(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    """``trainwatch --attach-torchrun [options]``: run the daemon until SIGINT/SIGTERM."""
    from sidecar.front.service import configure_logging, serve

    settings = settings_from(ns, env, DAEMON)
    configure_logging(settings.log_level)
    return serve(settings)


def run_verb(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    """``trainwatch run [options] -- COMMAND...``: the settings parsed here, then run."""
    from sidecar.front.run import run_command

    explicit_port = ns.port is not None or bool(env.get("TRAINWATCH_PORT"))
    if ns.log_level is None and not env.get("TRAINWATCH_LOG_LEVEL"):
        ns.log_level = "WARNING"  # the terminal belongs to the job
    return run_command(settings_from(ns, env, RUN), ns.command, explicit_port=explicit_port, environ=env)


def postmortem_command(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    """``trainwatch postmortem [ID|PATH|URL] [--format text|json] [--postmortem-dir DIR]
    [--host ADDR] [--port PORT]``: print one postmortem. Without an argument: the newest in
    the postmortem directory, else the one the local daemon serves (its --host and --port,
    or their TRAINWATCH_* variables)."""
    import json

    from sidecar.front.postmortems import find_postmortem
    from sidecar.postmortem import render_text

    settings = settings_from(ns, env, POSTMORTEM)
    host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    local = f"http://{'[' + host + ']' if ':' in host else host}:{settings.port}/postmortem"
    doc = find_postmortem(ns.what, settings.postmortem_dir, local)
    sys.stdout.write(json.dumps(doc, indent=1) + "\n" if ns.format == "json" else render_text(doc))
    return 0


def diagnose_command(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    """``trainwatch diagnose [FILE|-]... [--format text|json|html]``."""

    from sidecar.diagnose import DiagnoseError, diagnose, read_inputs
    from sidecar.postmortem import render_text
    from sidecar.postmortem.html import render_html

    try:
        inputs = read_inputs(ns.files)
    except DiagnoseError as exc:
        raise ConfigError(str(exc)) from None
    _write(diagnose(inputs), ns.format, render_text, render_html)
    return 0


def _write(doc: dict[str, Any], fmt: str, text: Callable[[Any], str], page: Callable[[Any], str]) -> None:
    """A document on standard output as JSON, text or HTML."""
    import json

    if fmt == "json":
        sys.stdout.write(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(page(doc) if fmt == "html" else text(doc))


def story_command(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    """``trainwatch story --prometheus URL [--job RUN_ID] [--format json|text|html]``."""

    from sidecar.story import (
        NoDeath,
        PromError,
        load_peer_config,
        parse_window,
        render_html,
        render_text,
        tell,
    )

    settings = settings_from(ns, env, STORY)
    if settings.prometheus is None:
        raise ConfigError("--prometheus URL is needed (or TRAINWATCH_PROMETHEUS)")
    url = settings.prometheus
    try:
        window = parse_window(ns.window)
    except ValueError:
        raise ConfigError(
            f"--window: expected a duration from 1m to 400d (30m, 6h, 7d), got {ns.window!r}"
        ) from None
    try:
        timeout = float(ns.timeout)
    except ValueError:
        timeout = -1.0
    if not 0.1 <= timeout <= 60:
        raise ConfigError(f"--timeout: expected 0.1 to 60 seconds, got {ns.timeout!r}")
    peers = load_peer_config(settings.peer_config)
    if ns.job is not None and not ns.job:
        raise ConfigError("--job: empty run id")
    try:
        doc = tell(url, ns.job, window=window, peers=peers, timeout=timeout)
    except (NoDeath, PromError) as exc:
        raise ConfigError(str(exc)) from None
    _write(doc, ns.format, render_text, render_html)
    return 0


def doctor_command(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    """``trainwatch doctor [options] [--strict]``: the checks for the daemon these options
    describe; with --strict, exit status 1 when one it relies on fails."""
    from sidecar.front.doctor import checks, missing, render

    results = checks(settings_from(ns, env, DOCTOR))
    sys.stdout.write(render(results))
    return 1 if ns.strict and missing(results) else 0


def demo_command(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    from sidecar.front.demo import run_demo

    return run_demo()


def completion_command(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    from sidecar.front.manual import completion

    sys.stdout.write(completion(ns.shell))
    return 0


def _handler(path: str) -> Callable[[argparse.Namespace, Mapping[str, str]], int]:
    module, name = path.split(":")
    fn: Callable[[argparse.Namespace, Mapping[str, str]], int]
    fn = getattr(importlib.import_module(module), name)
    return fn


def _dispatch(args: list[str], env: Mapping[str, str]) -> int:
    if not args or (args[0] == "help" and len(args) == 1):
        sys.stdout.write(listing())
        return 0
    if args[0] == "help":
        args = [args[1], "--help"]
    verb = next((v for v in VERBS[1:] if v.name == args[0]), None)
    if verb is None:
        if not args[0].startswith("-"):
            raise ConfigError(f"unknown verb {args[0]!r} (trainwatch help lists them)")
        verb, rest = VERBS[0], args
    else:
        rest = args[1:]
    command: list[str] = []
    if verb.name == RUN:
        if "--" not in rest:
            if "-h" in rest or "--help" in rest:
                parser_for(RUN).parse_args(["--help"])
            raise ConfigError(
                "run: give the command after --, e.g. trainwatch run -- torchrun --nproc-per-node=4 train.py"
            )
        i = rest.index("--")
        rest, command = rest[:i], rest[i + 1 :]
        if any(a == "--pid" or a.startswith("--pid=") for a in rest):
            raise ConfigError("run: --pid does not apply: run watches the command it starts")
        if not command and not ({"-h", "--help"} & set(rest)):
            raise ConfigError("run: nothing after --: give the command to run (torchrun ...)")
    ns = parser_for(verb.name).parse_args(rest)
    ns.command = command
    return _handler(verb.handler)(ns, env)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    try:
        return _dispatch(args, env)
    except ConfigError as exc:
        print(f"trainwatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
