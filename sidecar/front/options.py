"""The daemon's options, declared once.

``OPTIONS`` is the one table: each row is a flag, its ``TRAINWATCH_*`` variable, the default
shown in ``--help``, what it means, how its value is checked and which verbs take it. The
parsers of the daemon, ``run`` and ``doctor`` are built from it, ``parse_args(argv, environ)
-> Settings`` (pure, tested) reads it, and ``docs/options.md`` is rendered from it
(``manual.render_options``; a test keeps the page current). An option wins over its variable; a bad
value is a ``ConfigError`` naming the option or the variable that gave it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from sidecar import __version__
from sidecar.errors import ConfigError
from sidecar.settings import (
    DEFAULT_HISTORY_SECONDS,
    DEFAULT_INTERVAL_SECONDS,
    DEFAULT_PORT,
    EVIDENCE_SOURCES,
    Settings,
    default_postmortem_dir,
)

__all__ = [
    "OPTIONS",
    "Option",
    "StrictParser",
    "add_options",
    "build_parser",
    "check_prometheus_url",
    "parse_args",
    "settings_from",
]

MIN_INTERVAL_SECONDS = 0.1
MAX_INTERVAL_SECONDS = 3600.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
WEEK_SECONDS = 7 * 86400.0

DAEMON, RUN, DOCTOR, POSTMORTEM, STORY = "daemon", "run", "doctor", "postmortem", "story"
WATCHING = frozenset({DAEMON, RUN, DOCTOR})  # the verbs that run (or check) the daemon


class StrictParser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line, exit status 2) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


# -- value checks: (raw text, the name to blame) -> value, or ConfigError ------------------


def _seconds(lo: float, hi: float) -> Callable[[str, str], float]:
    def check(raw: str, name: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected a number of seconds, got {raw!r}") from None
        if not (lo <= value <= hi):
            raise ConfigError(f"{name}: must be between {lo:g} and {hi:g} seconds, got {raw}")
        return value

    return check


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def _duration(lo: float, hi: float) -> Callable[[str, str], float]:
    """Seconds, or a number with s, m or h: ``90``, ``90s``, ``5m``, ``1h``."""

    def check(raw: str, name: str) -> float:
        text = raw.strip()
        unit = _DURATION_UNITS.get(text[-1:].lower(), 0.0)
        try:
            value = float(text[:-1] if unit else text) * (unit or 1.0)
        except ValueError:
            raise ConfigError(f"{name}: expected a duration (90, 90s, 5m, 1h), got {raw!r}") from None
        if not (lo <= value <= hi):
            raise ConfigError(f"{name}: must be between {lo:g} and {hi:g} seconds, got {raw}")
        return value

    return check


def _truthy(raw: str, name: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected 1/0, true/false, yes/no, got {raw!r}")


def _pid(raw: str, name: str) -> int:
    if not raw.strip().isdigit() or int(raw) <= 0:
        raise ConfigError(f"{name}: expected a process id, got {raw!r}")
    return int(raw)


def _port(raw: str, name: str) -> int:
    if not raw.isdigit() or int(raw) > 65535:
        raise ConfigError(f"{name}: expected a port number 0-65535, got {raw!r}")
    return int(raw)


def _host(raw: str, name: str) -> str:
    if not raw.strip():
        raise ConfigError(f"{name}: empty address")
    return raw.strip()


def _level(raw: str, name: str) -> str:
    if raw.upper() not in LOG_LEVELS:
        raise ConfigError(f"{name}: expected one of {', '.join(LOG_LEVELS)}, got {raw!r}")
    return raw.upper()


def _directory(raw: str, name: str) -> str:
    path = os.path.abspath(os.path.expanduser(raw))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{name}: {path} exists and is not a directory")
    return path


def _file(raw: str, name: str) -> str:
    return os.path.abspath(os.path.expanduser(raw))


def _existing_file(raw: str, name: str) -> str:
    path = _file(raw, name)
    if not os.path.isfile(path):
        raise ConfigError(f"{name}: {path}: no such file")
    return path


def _source(raw: str, name: str) -> str:
    if raw.strip() not in EVIDENCE_SOURCES:
        raise ConfigError(f"{name}: expected one of {', '.join(EVIDENCE_SOURCES)}, got {raw.strip()!r}")
    return raw.strip()


def _oom_score_adj(raw: str, name: str) -> int | None:
    if raw.strip() == "keep":
        return None
    if not raw.strip().lstrip("-").isdigit() or not -1000 <= int(raw) <= 1000:
        raise ConfigError(f"{name}: expected a number from -1000 to 1000 or 'keep', got {raw!r}")
    return int(raw)


def _buffer(raw: str, name: str) -> int:
    if not raw.strip().isdigit() or not 4096 <= int(raw) <= 1 << 30:
        raise ConfigError(f"{name}: expected bytes from 4096 to 1 GiB, got {raw!r}")
    return int(raw)


def check_prometheus_url(raw: str, name: str) -> str:
    """An http(s) URL with a host, or a ConfigError naming the option."""
    import urllib.parse

    parts = urllib.parse.urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{name}: expected an http(s) URL of Prometheus, got {raw!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(f"{name}: bad port in {raw!r}") from None
    return raw.strip()


# -- the table ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """One option of the daemon. ``flag`` None: set by its variable only. A ``switch`` takes no
    value: the flag sets ``on`` (``off_flag`` sets the opposite); its variable is 1/0. A
    ``repeat`` flag may be given again; its values, and its variable's, may be comma-separated."""

    flag: str | None
    var: str
    field: str  # the Settings field it sets
    help: str
    default: str  # as shown in --help and docs/options.md
    check: Callable[[str, str], Any] = _file
    metavar: str | None = None
    switch: bool = False
    on: Any = True
    off_flag: str | None = None
    off_help: str = ""
    repeat: bool = False
    verbs: frozenset[str] = WATCHING

    @property
    def dest(self) -> str:
        return self.field


OPTIONS: tuple[Option, ...] = (
    Option(
        flag="--attach-torchrun",
        var="TRAINWATCH_ATTACH_TORCHRUN",
        field="attach_torchrun",
        help="run the daemon: find and watch the distributed training jobs on this machine",
        default="off (required to run the daemon)",
        switch=True,
        verbs=frozenset({DAEMON}),
    ),
    Option(
        flag="--pid",
        var="TRAINWATCH_PID",
        field="pids",
        metavar="PID",
        help="watch only this torchrun agent (or the agents below this process); repeatable",
        default="every job",
        check=_pid,
        repeat=True,
        verbs=frozenset({DAEMON, DOCTOR}),
    ),
    Option(
        flag="--interval",
        var="TRAINWATCH_INTERVAL",
        field="interval_seconds",
        metavar="SECONDS",
        help=f"sampling period, {MIN_INTERVAL_SECONDS} s or more (10 Hz near a memory limit whatever it is)",
        default=f"{DEFAULT_INTERVAL_SECONDS}",
        check=_seconds(MIN_INTERVAL_SECONDS, MAX_INTERVAL_SECONDS),
    ),
    Option(
        flag="--host",
        var="TRAINWATCH_HOST",
        field="host",
        metavar="ADDR",
        help="address to serve HTTP on; beyond loopback, give --web-config too",
        default="127.0.0.1",
        check=_host,
        verbs=WATCHING | {POSTMORTEM},
    ),
    Option(
        flag="--port",
        var="TRAINWATCH_PORT",
        field="port",
        metavar="PORT",
        help="port to serve HTTP on; 0 picks a free one and logs it",
        default=str(DEFAULT_PORT),
        check=_port,
        verbs=WATCHING | {POSTMORTEM},
    ),
    Option(
        flag="--postmortem-dir",
        var="TRAINWATCH_POSTMORTEM_DIR",
        field="postmortem_dir",
        metavar="DIR",
        help="where postmortems (and the daemon's journal) are written",
        default="/var/lib/trainwatch/postmortems as root, else $XDG_STATE_HOME/trainwatch/postmortems",
        check=_directory,
        verbs=WATCHING | {POSTMORTEM},
    ),
    Option(
        flag="--history",
        var="TRAINWATCH_HISTORY",
        field="history_seconds",
        metavar="SECONDS",
        help="memory history kept per job (the curves of a postmortem), at least the interval",
        default=f"{DEFAULT_HISTORY_SECONDS:g}",
        check=_seconds(1.0, WEEK_SECONDS),
    ),
    Option(
        flag="--log-level",
        var="TRAINWATCH_LOG_LEVEL",
        field="log_level",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR",
        default="INFO (WARNING under run)",
        check=_level,
    ),
    Option(
        flag="--stall-after",
        var="TRAINWATCH_STALL_AFTER",
        field="stall_after_seconds",
        metavar="SECONDS",
        help="a rank that makes no progress this long (no CPU and no GPU use, or its GPU busy while a "
        "peer's is silent) has its job reported stalled, and the stall snapshot taken",
        default="60",
        check=_seconds(1.0, WEEK_SECONDS),
    ),
    Option(
        flag="--end-stranded-after",
        var="TRAINWATCH_END_STRANDED_AFTER",
        field="end_stranded_after_seconds",
        metavar="DURATION",
        help="once ranks of this job have been stranded this long (alive and making no progress after "
        "another rank died: 90, 90s, 5m), end the job: SIGTERM to the command and every rank, SIGKILL "
        "to what is left 10 s later; run then exits with status 124",
        default="off: a stranded job is reported, never ended",
        check=_duration(1.0, WEEK_SECONDS),
        verbs=frozenset({RUN}),
    ),
    Option(
        flag="--py-spy",
        var="TRAINWATCH_PY_SPY",
        field="py_spy",
        help="require py-spy stacks in the stall snapshot (warn when py-spy is missing or not permitted)",
        default="stacks wherever py-spy is installed and ptrace is permitted",
        switch=True,
        off_flag="--no-py-spy",
        off_help="take no py-spy stacks at a stall",
    ),
    Option(
        flag="--disable",
        var="TRAINWATCH_DISABLE",
        field="disabled",
        metavar="SOURCE",
        help="turn an evidence source off, repeatable: " + ", ".join(EVIDENCE_SOURCES),
        default="none",
        check=_source,
        repeat=True,
    ),
    Option(
        flag="--web-config",
        var="TRAINWATCH_WEB_CONFIG",
        field="web_config",
        metavar="FILE",
        help="the Prometheus exporter-toolkit web config: TLS, client certificates and allowed SANs, "
        "response headers, a rate limit, basic auth; every key honoured or refused by name, the file "
        "read again when it changes; needs the web extra (PyYAML, bcrypt)",
        default="none: plain HTTP",
    ),
    Option(
        flag="--prometheus",
        var="TRAINWATCH_PROMETHEUS",
        field="prometheus",
        metavar="URL",
        help="the Prometheus that scrapes every node's daemon: serves GET /story?job=RUN_ID, one "
        "story of a job across nodes (trainwatch story --help)",
        default="none: no /story",
        check=check_prometheus_url,
        verbs=WATCHING | {STORY},
    ),
    Option(
        flag="--peer-config",
        var="TRAINWATCH_PEER_CONFIG",
        field="peer_config",
        metavar="FILE",
        help="credentials for reading the other nodes' daemons (and --prometheus) for /story: "
        "basic_auth and tls_config as in a Prometheus scrape config; needs the web extra (PyYAML)",
        default="none",
        check=_existing_file,
        verbs=WATCHING | {STORY},
    ),
    Option(
        flag="--oom-score-adj",
        var="TRAINWATCH_OOM_SCORE_ADJ",
        field="oom_score_adj",
        metavar="N",
        help="the daemon's own oom_score_adj, -1000 to 1000, or 'keep' "
        "(-1000: never the OOM killer's choice)",
        default="-1000",
        check=_oom_score_adj,
    ),
    Option(
        flag="--no-self-protection",
        var="TRAINWATCH_SELF_PROTECTION",
        field="self_protection",
        help="do not lock the daemon's memory or raise its death path's priority "
        "(the variable: TRAINWATCH_SELF_PROTECTION=0)",
        default="on",
        switch=True,
        on=False,
    ),
    Option(
        flag=None,
        var="TRAINWATCH_CONNECTOR_BUFFER",
        field="connector_buffer_bytes",
        metavar="BYTES",
        help="the process connector's receive buffer: on a node with many thousands of exits a second, "
        "a larger one overruns less",
        default=str(8 << 20),
        check=_buffer,
    ),
)


def add_options(p: argparse.ArgumentParser, verb: str) -> None:
    """The table's flags that ``verb`` takes, each with its default and variable in its help."""
    for o in OPTIONS:
        if verb not in o.verbs or o.flag is None:
            continue
        where = f" (default {o.default}; {o.var})"
        if o.switch and o.off_flag:
            group = p.add_mutually_exclusive_group()
            group.add_argument(o.flag, dest=o.dest, action="store_const", const=True, help=o.help + where)
            group.add_argument(o.off_flag, dest=o.dest, action="store_const", const=False, help=o.off_help)
        elif o.switch:
            p.add_argument(o.flag, dest=o.dest, action="store_const", const=o.on, help=o.help + where)
        else:
            p.add_argument(
                o.flag,
                dest=o.dest,
                metavar=o.metavar,
                action="append" if o.repeat else "store",
                help=o.help + where,
            )
    p.set_defaults(**{o.dest: None for o in OPTIONS if verb in o.verbs})


def settings_from(ns: argparse.Namespace, environ: Mapping[str, str], verb: str) -> Settings:
    """Settings from a namespace that ``add_options(parser, verb)`` filled and the variables:
    an option wins over its variable; a bad value names whichever gave it."""
    values: dict[str, Any] = {}
    for o in OPTIONS:
        if verb not in o.verbs:
            continue
        given = getattr(ns, o.dest, None)
        raw_env = environ.get(o.var)
        if given is not None:
            raws, name = (given if o.repeat else [given]), o.flag or o.var
        elif raw_env not in (None, ""):
            assert raw_env is not None
            raws, name = [raw_env], o.var
        else:
            continue
        if o.switch:  # the flag's constant, or the variable's 1/0 as the field's value
            values[o.field] = raws[0] if given is not None else _truthy(raws[0], name)
            continue
        if o.repeat:
            checked = [o.check(i, name) for raw in raws for i in raw.replace(",", " ").split()]
            values[o.field] = tuple(checked) if o.field == "pids" else frozenset(checked)
        else:
            values[o.field] = o.check(raws[0], name)
    if verb == DAEMON and not values.get("attach_torchrun"):
        raise ConfigError("nothing to do: pass --attach-torchrun to watch training jobs (see --help)")
    interval = values.get("interval_seconds", DEFAULT_INTERVAL_SECONDS)
    if values.get("history_seconds", DEFAULT_HISTORY_SECONDS) < interval:
        name = "--history" if getattr(ns, "history_seconds", None) is not None else "TRAINWATCH_HISTORY"
        raise ConfigError(f"{name}: must be at least the sampling interval ({interval:g} s)")
    values["attach_torchrun"] = True
    if "postmortem_dir" not in values:
        values["postmortem_dir"] = default_postmortem_dir()
    return Settings(**values)


DESCRIPTION = """\
Watch the distributed training jobs on this machine: per-rank host memory (with DataLoader
workers), GPU memory (NVML), memory cgroup limits and host memory, served as Prometheus
metrics on /metrics, with a live JSON view on /ranks and a health check on /healthz; when a
rank dies, a postmortem that names what killed it, on /postmortem."""


def _epilog() -> str:
    sources = "\n".join(f"  {name:<11} {what}" for name, what in EVIDENCE_SOURCES.items())
    return (
        "Every option can also be set by its environment variable (shown with it); options win.\n"
        "TRAINWATCH_CONNECTOR_BUFFER (bytes, default 8 MiB) sizes the process connector's receive\n"
        "buffer. Evidence sources (--disable turns one off; trainwatch doctor says which work here):\n"
        f"{sources}\n\n"
        "Run as root (or with CAP_SYS_PTRACE) to read every job's environment; without it, other\n"
        "users' ranks are numbered by start order. Exit status: 0 after SIGINT/SIGTERM, 1 on a\n"
        "failure at run time, 2 on a bad option. The other verbs: trainwatch help."
    )


def build_parser() -> argparse.ArgumentParser:
    """The daemon's parser (``trainwatch --attach-torchrun ...``)."""
    p = StrictParser(
        prog="trainwatch",
        usage="trainwatch --attach-torchrun [options]",
        description=DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, DAEMON)
    p.add_argument("--version", action="version", version=f"trainwatch {__version__}")
    return p


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """Turn the daemon's argv and TRAINWATCH_* variables into Settings. Raises ConfigError
    whose message names the bad flag or variable."""
    env = os.environ if environ is None else environ
    return settings_from(build_parser().parse_args(list(argv)), env, DAEMON)
