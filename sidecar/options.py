"""The daemon's options: ``parse_args(argv, environ) -> Settings`` is pure and tested. Every
option has an environment variable (``TRAINWATCH_*``); an option wins over its variable; a
bad value is a ``ConfigError`` naming the option. Used by ``cli`` (the daemon) and ``run``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import NoReturn

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

__all__ = ["StrictParser", "build_parser", "parse_args"]

MIN_INTERVAL_SECONDS = 0.1
MAX_INTERVAL_SECONDS = 3600.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

DESCRIPTION = """\
Watch torchrun jobs on this machine: per-rank host memory (with DataLoader workers),
GPU memory (NVML), memory cgroup limits and host memory, served as Prometheus metrics
on /metrics, with a live JSON view on /ranks and a health check on /healthz."""

EPILOG = """\
Also: trainwatch run [options] -- torchrun ARGS... starts a job and watches it (its output
passes through and is kept as evidence; the exit status is torchrun's);
trainwatch postmortem [ID|PATH|URL] prints a postmortem in the terminal;
trainwatch diagnose [FILE|-]... names the killer from logs after the fact (torchrun output,
dmesg, Slurm/Kubernetes/Docker/Ray messages: --help for more);
trainwatch story --prometheus URL [--job RUN_ID] tells one job's death across nodes, joined
from every node's daemon through the Prometheus that scrapes them;
trainwatch doctor says which evidence sources work here and how to get the missing ones;
trainwatch demo runs a small real torchrun job in which a rank exceeds a memory limit.

Every option can also be set by an environment variable: TRAINWATCH_ATTACH_TORCHRUN=1,
TRAINWATCH_PID (comma-separated), TRAINWATCH_INTERVAL, TRAINWATCH_HOST, TRAINWATCH_PORT,
TRAINWATCH_POSTMORTEM_DIR, TRAINWATCH_HISTORY, TRAINWATCH_LOG_LEVEL, TRAINWATCH_STALL_AFTER,
TRAINWATCH_PY_SPY=1|0, TRAINWATCH_DISABLE (comma-separated), TRAINWATCH_WEB_CONFIG,
TRAINWATCH_OOM_SCORE_ADJ, TRAINWATCH_SELF_PROTECTION=0, TRAINWATCH_PROMETHEUS,
TRAINWATCH_PEER_CONFIG. Options win over variables.
TRAINWATCH_CONNECTOR_BUFFER (bytes, default 8 MiB) sizes the process connector's receive
buffer: on a node with many thousands of exits a second, a larger one overruns less.

Evidence sources (--disable turns one off; trainwatch doctor says which work here):
  connector   the netlink process connector: exit statuses from the kernel (root)
  pidfd       pidfds on the ranks: exit statuses where the connector is refused
  kmsg        /dev/kmsg: the kernel's OOM records (root or CAP_SYSLOG)
  tracepoint  signal:signal_generate in a private tracefs instance: who sent a kill
  outputs     the agent's, ranks' and OOM daemons' stdout/stderr, where they are regular files
  smaps       /proc/PID/smaps_rollup: PSS, USS of each rank's tree (every 30 s or on growth, <= 1 % of a core)

Run as root (or with CAP_SYS_PTRACE) to read every job's environment; without it,
other users' ranks are numbered by start order. Exit status: 0 after SIGINT/SIGTERM,
1 on a failure at run time, 2 on a bad option."""


class StrictParser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line, exit status 2) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = StrictParser(
        prog="trainwatch",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--attach-torchrun",
        action="store_true",
        default=None,
        help="run the daemon: find and watch torchrun jobs",
    )
    p.add_argument(
        "--pid",
        action="append",
        metavar="PID",
        default=None,
        help="watch only this torchrun agent (or the agents below this process); repeatable",
    )
    p.add_argument(
        "--interval",
        metavar="SECONDS",
        default=None,
        help=f"sampling period, {MIN_INTERVAL_SECONDS} s or more (default {DEFAULT_INTERVAL_SECONDS})",
    )
    p.add_argument(
        "--host", metavar="ADDR", default=None, help="address to serve HTTP on (default 127.0.0.1)"
    )
    p.add_argument(
        "--port",
        metavar="PORT",
        default=None,
        help=f"port to serve HTTP on; 0 picks a free one and logs it (default {DEFAULT_PORT})",
    )
    p.add_argument(
        "--postmortem-dir",
        metavar="DIR",
        default=None,
        help=f"where postmortems are written (default {default_postmortem_dir()})",
    )
    p.add_argument(
        "--history",
        metavar="SECONDS",
        default=None,
        help=f"memory history kept per job (default {DEFAULT_HISTORY_SECONDS:g})",
    )
    p.add_argument(
        "--log-level", metavar="LEVEL", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)"
    )
    p.add_argument(
        "--stall-after",
        metavar="SECONDS",
        default=None,
        help="a rank that makes no progress this long (no CPU and no GPU use, or its GPU busy "
        "while a peer's is silent) has its job reported stalled, and the stall snapshot taken (default 60)",
    )
    spy = p.add_mutually_exclusive_group()
    spy.add_argument(
        "--py-spy",
        dest="py_spy",
        action="store_const",
        const=True,
        default=None,
        help="require py-spy stacks in the stall snapshot (warn when py-spy is missing or not "
        "permitted); by default they are taken wherever py-spy is installed and ptrace is permitted",
    )
    spy.add_argument(
        "--no-py-spy",
        dest="py_spy",
        action="store_const",
        const=False,
        help="take no py-spy stacks at a stall",
    )
    p.add_argument(
        "--disable",
        action="append",
        metavar="SOURCE",
        default=None,
        help="turn an evidence source off, repeatable: " + ", ".join(EVIDENCE_SOURCES),
    )
    p.add_argument(
        "--web-config",
        metavar="FILE",
        default=None,
        help="the Prometheus exporter-toolkit web config: TLS, client certificates and allowed SANs, "
        "response headers, a rate limit, basic auth; every key honoured or refused by name, the file read "
        "again when it changes; needs trainwatch[web]",
    )
    p.add_argument(
        "--prometheus",
        metavar="URL",
        default=None,
        help="the Prometheus that scrapes every node's daemon: serves GET /story?job=RUN_ID, one "
        "story of a job across nodes (trainwatch story --help)",
    )
    p.add_argument(
        "--peer-config",
        metavar="FILE",
        default=None,
        help="credentials for reading the other nodes' daemons (and --prometheus) for /story: "
        "basic_auth and tls_config as in a Prometheus scrape config; needs trainwatch[web]",
    )
    p.add_argument(
        "--oom-score-adj",
        metavar="N",
        default=None,
        help="the daemon's own oom_score_adj, -1000 to 1000, or 'keep' (default -1000: never the "
        "OOM killer's choice)",
    )
    p.add_argument(
        "--no-self-protection",
        action="store_true",
        default=None,
        help="do not lock the daemon's memory or raise its death path's priority",
    )
    p.add_argument("--version", action="version", version=f"trainwatch {__version__}")
    return p


def _pick(flag_value: str | None, env: Mapping[str, str], var: str, flag: str) -> tuple[str | None, str]:
    """The value and the name to blame when it is bad (the flag wins over the variable)."""
    if flag_value is not None:
        return flag_value, flag
    value = env.get(var)
    return (value if value not in (None, "") else None), var


def _number(raw: str, name: str, lo: float, hi: float) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected a number of seconds, got {raw!r}") from None
    if not (lo <= value <= hi):
        raise ConfigError(f"{name}: must be between {lo:g} and {hi:g} seconds, got {raw}")
    return value


def _truthy(raw: str, name: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected 1/0, true/false, yes/no, got {raw!r}")


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


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """Turn argv and TRAINWATCH_* variables into Settings. Raises ConfigError whose
    message names the bad flag or variable."""
    env = os.environ if environ is None else environ
    ns = build_parser().parse_args(list(argv))

    attach = bool(ns.attach_torchrun)
    if not attach and env.get("TRAINWATCH_ATTACH_TORCHRUN"):
        attach = _truthy(env["TRAINWATCH_ATTACH_TORCHRUN"], "TRAINWATCH_ATTACH_TORCHRUN")
    if not attach:
        raise ConfigError("nothing to do: pass --attach-torchrun to watch torchrun jobs (see --help)")

    pids: list[int] = []
    raw_pids: list[tuple[str, str]] = [(p, "--pid") for p in ns.pid or []]
    if not raw_pids and env.get("TRAINWATCH_PID"):
        raw_pids = [(p, "TRAINWATCH_PID") for p in env["TRAINWATCH_PID"].replace(",", " ").split()]
    for raw_pid, source in raw_pids:
        if not raw_pid.strip().isdigit() or int(raw_pid) <= 0:
            raise ConfigError(f"{source}: expected a process id, got {raw_pid!r}")
        pids.append(int(raw_pid))

    raw, name = _pick(ns.interval, env, "TRAINWATCH_INTERVAL", "--interval")
    interval = (
        DEFAULT_INTERVAL_SECONDS
        if raw is None
        else _number(raw, name, MIN_INTERVAL_SECONDS, MAX_INTERVAL_SECONDS)
    )

    raw, name = _pick(ns.history, env, "TRAINWATCH_HISTORY", "--history")
    history = DEFAULT_HISTORY_SECONDS if raw is None else _number(raw, name, 1.0, 7 * 86400.0)
    if history < interval:
        raise ConfigError(f"{name}: must be at least the sampling interval ({interval:g} s)")

    raw, name = _pick(ns.port, env, "TRAINWATCH_PORT", "--port")
    port = DEFAULT_PORT
    if raw is not None:
        if not raw.isdigit() or int(raw) > 65535:
            raise ConfigError(f"{name}: expected a port number 0-65535, got {raw!r}")
        port = int(raw)

    raw, name = _pick(ns.host, env, "TRAINWATCH_HOST", "--host")
    host = "127.0.0.1" if raw is None else raw.strip()
    if not host:
        raise ConfigError(f"{name}: empty address")

    raw, name = _pick(ns.log_level, env, "TRAINWATCH_LOG_LEVEL", "--log-level")
    level = "INFO" if raw is None else raw.upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{name}: expected one of {', '.join(LOG_LEVELS)}, got {raw!r}")

    raw, name = _pick(ns.postmortem_dir, env, "TRAINWATCH_POSTMORTEM_DIR", "--postmortem-dir")
    pm_dir = default_postmortem_dir() if raw is None else os.path.abspath(os.path.expanduser(raw))
    if os.path.exists(pm_dir) and not os.path.isdir(pm_dir):
        raise ConfigError(f"{name}: {pm_dir} exists and is not a directory")

    raw, name = _pick(ns.stall_after, env, "TRAINWATCH_STALL_AFTER", "--stall-after")
    stall_after = 60.0 if raw is None else _number(raw, name, 1.0, 7 * 86400.0)
    py_spy: bool | None = ns.py_spy
    if py_spy is None and env.get("TRAINWATCH_PY_SPY"):
        py_spy = _truthy(env["TRAINWATCH_PY_SPY"], "TRAINWATCH_PY_SPY")

    raw, name = _pick(ns.oom_score_adj, env, "TRAINWATCH_OOM_SCORE_ADJ", "--oom-score-adj")
    oom_score_adj: int | None = -1000
    if raw is not None:
        if raw.strip() == "keep":
            oom_score_adj = None
        elif not raw.strip().lstrip("-").isdigit() or not -1000 <= int(raw) <= 1000:
            raise ConfigError(f"{name}: expected a number from -1000 to 1000 or 'keep', got {raw!r}")
        else:
            oom_score_adj = int(raw)
    protect = not ns.no_self_protection
    if protect and env.get("TRAINWATCH_SELF_PROTECTION"):
        protect = _truthy(env["TRAINWATCH_SELF_PROTECTION"], "TRAINWATCH_SELF_PROTECTION")

    raw, name = _pick(ns.web_config, env, "TRAINWATCH_WEB_CONFIG", "--web-config")
    web_config = None if raw is None else os.path.abspath(os.path.expanduser(raw))

    raw, name = _pick(ns.prometheus, env, "TRAINWATCH_PROMETHEUS", "--prometheus")
    prometheus = None if raw is None else check_prometheus_url(raw, name)
    raw, name = _pick(ns.peer_config, env, "TRAINWATCH_PEER_CONFIG", "--peer-config")
    peer_config = None if raw is None else os.path.abspath(os.path.expanduser(raw))
    if peer_config is not None and not os.path.isfile(peer_config):
        raise ConfigError(f"{name}: {peer_config}: no such file")

    raw = env.get("TRAINWATCH_CONNECTOR_BUFFER")
    connector_buffer = 8 << 20
    if raw is not None:
        if not raw.strip().isdigit() or not 4096 <= int(raw) <= 1 << 30:
            raise ConfigError(f"TRAINWATCH_CONNECTOR_BUFFER: expected bytes from 4096 to 1 GiB, got {raw!r}")
        connector_buffer = int(raw)

    disabled: set[str] = set()
    raw_disabled = [(d, "--disable") for d in ns.disable or []]
    if not raw_disabled and env.get("TRAINWATCH_DISABLE"):
        raw_disabled = [(d, "TRAINWATCH_DISABLE") for d in env["TRAINWATCH_DISABLE"].split(",")]
    for raw_source, source in raw_disabled:
        for item in raw_source.split(","):
            if item.strip() not in EVIDENCE_SOURCES:
                raise ConfigError(
                    f"{source}: expected one of {', '.join(EVIDENCE_SOURCES)}, got {item.strip()!r}"
                )
            disabled.add(item.strip())

    return Settings(
        attach_torchrun=True,
        disabled=frozenset(disabled),
        stall_after_seconds=stall_after,
        py_spy=py_spy,
        oom_score_adj=oom_score_adj,
        web_config=web_config,
        prometheus=prometheus,
        peer_config=peer_config,
        self_protection=protect,
        connector_buffer_bytes=connector_buffer,
        pids=tuple(pids),
        interval_seconds=interval,
        host=host,
        port=port,
        postmortem_dir=pm_dir,
        history_seconds=history,
        log_level=level,
    )
