"""The command line: the verbs (the daemon, ``run``, ``postmortem``, ``diagnose``,
``doctor``, ``demo``) and the one place that turns errors into one-line advice and exit
statuses (0 done, 1 failure at run time, 2 bad usage). Options: ``options.py``; the daemon
and its HTTP server: ``service.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sidecar.errors import ConfigError
from sidecar.options import StrictParser, build_parser, parse_args
from sidecar.service import configure_logging, serve
from sidecar.settings import DEFAULT_PORT, Settings, default_postmortem_dir

__all__ = ["main", "parse_args"]


def postmortem_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """``trainwatch postmortem [ID|PATH|URL] [--format text|json] [--postmortem-dir DIR]``:
    print one postmortem. Without an argument: the newest in the postmortem directory,
    else the one a local daemon serves."""
    import json
    import urllib.error
    import urllib.request

    from sidecar.postmortem import ID_PATTERN, PostmortemStore, render_text

    env = os.environ if environ is None else environ
    p = StrictParser(prog="trainwatch postmortem", description="Print a postmortem in the terminal.")
    p.add_argument(
        "what", nargs="?", help="a postmortem id, a .json file, or a URL (http://host:port[/postmortem...])"
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--postmortem-dir", default=None, help="where to look for ids (default as the daemon's)")
    ns = p.parse_args(list(argv))
    directory = ns.postmortem_dir or env.get("TRAINWATCH_POSTMORTEM_DIR") or default_postmortem_dir()
    what: str | None = ns.what
    doc = None
    if what and (what.startswith("http://") or what.startswith("https://")):
        url = what if "/postmortem" in what else what.rstrip("/") + "/postmortem"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                doc = json.loads(r.read())
        except (urllib.error.URLError, ValueError, OSError) as exc:
            raise ConfigError(f"{what}: cannot fetch a postmortem: {getattr(exc, 'reason', exc)}") from None
    elif what and (os.path.sep in what or what.endswith(".json")):
        try:
            with open(what, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as exc:
            raise ConfigError(f"{what}: {exc.strerror}") from None
        except ValueError:
            raise ConfigError(f"{what}: not a postmortem (not JSON)") from None
    else:
        if what and not ID_PATTERN.match(what):
            raise ConfigError(f"{what!r} is not a postmortem id, a path or a URL")
        store = PostmortemStore(directory)
        doc = store.get(what) if what else store.newest()
        if doc is None and what is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{DEFAULT_PORT}/postmortem", timeout=3) as r:
                    doc = json.loads(r.read())
            except (urllib.error.URLError, ValueError, OSError):
                doc = None
        if doc is None:
            raise ConfigError(
                f"no postmortem {what or 'yet'} in {directory}"
                + ("" if what else f" nor at http://127.0.0.1:{DEFAULT_PORT}/postmortem")
            )
    if not isinstance(doc, dict) or doc.get("schema") != "trainwatch.postmortem/v1":
        raise ConfigError("not a trainwatch.postmortem/v1 document")
    sys.stdout.write(json.dumps(doc, indent=1) + "\n" if ns.format == "json" else render_text(doc))
    return 0


DIAGNOSE_HELP = """\
Name what killed a training job from its logs, after the fact.

Give any mix of files and standard input (-): the torchrun output (any torch version's
agent lines and failure table, the ranks' tracebacks and NCCL/gloo messages, DeepSpeed's or
accelerate's launcher), the kernel log (dmesg, dmesg -T, journalctl -k, kern.log), Slurm,
Kubernetes, Docker or Ray messages, earlyoom/systemd-oomd journal lines. What each file is
comes from its content. The answer is the same postmortem document the daemon writes, with
what the logs cannot tell set to null; when they cannot decide, it says so and lists what to
collect next time.

  dmesg -T | trainwatch diagnose - train.log
  trainwatch diagnose --format json slurm-1234.out kern.log

Exit status 0 when it ran (also when the answer is "unknown"), 2 when an input cannot be read.
"""


def diagnose_command(argv: Sequence[str]) -> int:
    """``trainwatch diagnose [FILE|-]... [--format text|json|html]``."""

    from sidecar.diagnose import DiagnoseError, diagnose, read_inputs
    from sidecar.postmortem import render_text
    from sidecar.postmortem.html import render_html

    p = StrictParser(
        prog="trainwatch diagnose",
        description=DIAGNOSE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "files", nargs="*", metavar="FILE", help="a log file, or - for standard input (the default)"
    )
    p.add_argument("--format", choices=("text", "json", "html"), default="text")
    ns = p.parse_args(list(argv))
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


STORY_HELP = """\
Tell one job's death across nodes: which rank on which node died first and of what, what
every other rank on every node did after it, in order, and what could not be seen.

Every node's daemon exports its deaths (trainwatch_rank_death_timestamp_seconds, with the
instance Prometheus scrapes it at); the story asks Prometheus which nodes saw the job die,
reads each node's postmortems from its daemon, bounds each node's clock against
Prometheus's from the scrapes, and joins them (schema trainwatch.story/v1). A daemon
started with --prometheus URL serves the same at GET /story?job=RUN_ID.

  trainwatch story --prometheus http://prometheus:9090
  trainwatch story --prometheus http://prometheus:9090 --job 4711 --format html > story.html

Exit status 0 with a story, 2 with a one-line error (Prometheus cannot be asked, no death
of the job in the window, a bad option).
"""


def story_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """``trainwatch story --prometheus URL [--job RUN_ID] [--format json|text|html]``."""

    from sidecar.options import check_prometheus_url
    from sidecar.story import (
        NoDeath,
        PromError,
        load_peer_config,
        parse_window,
        render_html,
        render_text,
        tell,
    )

    env = os.environ if environ is None else environ
    p = StrictParser(
        prog="trainwatch story", description=STORY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prometheus", metavar="URL", help="the Prometheus that scrapes the nodes' daemons "
                   "(TRAINWATCH_PROMETHEUS)")  # fmt: skip
    p.add_argument(
        "--job",
        metavar="RUN_ID",
        help="the job's run id, its job label (default: the newest job with a death)",
    )
    p.add_argument("--format", choices=("text", "json", "html"), default="text")
    p.add_argument(
        "--window", metavar="DURATION", default="1d", help="how far back to look: 30m, 6h, 7d (default 1d)"
    )
    p.add_argument(
        "--peer-config", metavar="FILE", help="credentials for the nodes' daemons and Prometheus "
        "(basic_auth, tls_config as in a Prometheus scrape config; TRAINWATCH_PEER_CONFIG)",
    )  # fmt: skip
    p.add_argument("--timeout", metavar="SECONDS", default="3", help="per request to a node (default 3)")
    ns = p.parse_args(list(argv))
    raw = ns.prometheus or env.get("TRAINWATCH_PROMETHEUS")
    if not raw:
        raise ConfigError("--prometheus URL is needed (or TRAINWATCH_PROMETHEUS)")
    url = check_prometheus_url(raw, "--prometheus" if ns.prometheus else "TRAINWATCH_PROMETHEUS")
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
    peers = load_peer_config(ns.peer_config or env.get("TRAINWATCH_PEER_CONFIG") or None)
    if ns.job is not None and not ns.job:
        raise ConfigError("--job: empty run id")
    try:
        doc = tell(url, ns.job, window=window, peers=peers, timeout=timeout)
    except (NoDeath, PromError) as exc:
        raise ConfigError(str(exc)) from None
    _write(doc, ns.format, render_text, render_html)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args:
            build_parser().print_help(sys.stderr)
            return 2
        if args[0] == "postmortem":
            return postmortem_command(args[1:])
        if args[0] == "diagnose":
            return diagnose_command(args[1:])
        if args[0] == "story":
            return story_command(args[1:])
        if args[0] == "run":
            from sidecar.run import run_command

            return run_command(args[1:])
        if args[0] == "demo":
            from sidecar.demo import run_demo

            return run_demo()
        if args[0] == "doctor":
            from sidecar.doctor import checks, render

            if len(args) > 1:
                raise ConfigError("doctor takes no arguments")
            sys.stdout.write(render(checks(Settings())))
            return 0
        settings = parse_args(args)
        configure_logging(settings.log_level)
        return serve(settings)
    except ConfigError as exc:
        print(f"trainwatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
