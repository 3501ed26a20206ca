"""The command line: the verbs (the daemon, ``run``, ``postmortem``, ``diagnose``,
``doctor``, ``demo``) and the one place that turns errors into one-line advice and exit
statuses (0 done, 1 failure at run time, 2 bad usage). Options: ``options.py``; the daemon
and its HTTP server: ``service.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

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
    import json

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
    doc = diagnose(inputs)
    if ns.format == "json":
        sys.stdout.write(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    elif ns.format == "html":
        sys.stdout.write(render_html(doc))
    else:
        sys.stdout.write(render_text(doc))
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
