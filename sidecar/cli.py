"""The command line: ``parse_args(argv, environ) -> Settings`` is pure and tested; ``main``
configures logging, runs the daemon and is the only place that turns errors into
one-line advice and exit statuses (0 done, 1 failure at run time, 2 bad usage).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
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

__all__ = ["main", "parse_args"]

log = logging.getLogger("trainwatch")

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
trainwatch doctor says which evidence sources work here and how to get the missing ones;
trainwatch demo runs a small real torchrun job in which a rank exceeds a memory limit.

Every option can also be set by an environment variable: TRAINWATCH_ATTACH_TORCHRUN=1,
TRAINWATCH_PID (comma-separated), TRAINWATCH_INTERVAL, TRAINWATCH_HOST, TRAINWATCH_PORT,
TRAINWATCH_POSTMORTEM_DIR, TRAINWATCH_HISTORY, TRAINWATCH_LOG_LEVEL, TRAINWATCH_STALL_AFTER,
TRAINWATCH_PY_SPY=1, TRAINWATCH_DISABLE (comma-separated). Options win over variables.

Evidence sources (--disable turns one off; trainwatch doctor says which work here):
  connector   the netlink process connector: exit statuses from the kernel (root)
  pidfd       pidfds on the ranks: exit statuses where the connector is refused
  kmsg        /dev/kmsg: the kernel's OOM records (root or CAP_SYSLOG)
  tracepoint  signal:signal_generate in a private tracefs instance: who sent a kill
  outputs     the agent's, ranks' and OOM daemons' stdout/stderr, where they are regular files

Run as root (or with CAP_SYS_PTRACE) to read every job's environment; without it,
other users' ranks are numbered by start order. Exit status: 0 after SIGINT/SIGTERM,
1 on a failure at run time, 2 on a bad option."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
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
        help="a job whose ranks all use no CPU this long is reported stalled (default 60)",
    )
    p.add_argument(
        "--py-spy",
        action="store_true",
        default=None,
        help="when a job stalls, record each rank's Python stack with py-spy (must be installed)",
    )
    p.add_argument(
        "--disable",
        action="append",
        metavar="SOURCE",
        default=None,
        help="turn an evidence source off, repeatable: " + ", ".join(EVIDENCE_SOURCES),
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


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """Turn argv and TRAINWATCH_* variables into Settings. Raises ConfigError whose
    message names the bad flag or variable."""
    env = os.environ if environ is None else environ
    ns = _parser().parse_args(list(argv))

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
    py_spy = bool(ns.py_spy)
    if not py_spy and env.get("TRAINWATCH_PY_SPY"):
        py_spy = _truthy(env["TRAINWATCH_PY_SPY"], "TRAINWATCH_PY_SPY")

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
        pids=tuple(pids),
        interval_seconds=interval,
        host=host,
        port=port,
        postmortem_dir=pm_dir,
        history_seconds=history,
        log_level=level,
    )


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if level != "DEBUG":
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _listen(settings: Settings) -> socket.socket:
    try:
        infos = socket.getaddrinfo(
            settings.host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(f"--host: cannot resolve {settings.host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"--port: cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
        ) from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def _prepare_postmortem_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=0o750, exist_ok=True)
    except OSError as exc:
        log.warning(
            "postmortem directory %s is not usable (%s): postmortems will be kept in memory only",
            path,
            exc.strerror,
        )
        return
    if not os.access(path, os.W_OK):
        log.warning("postmortem directory %s is not writable: postmortems will be kept in memory only", path)


SERVER_TICK_SECONDS = 1.0


def _quiet_server_class() -> type:
    import asyncio

    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn's main loop wakes every 0.1 s to look for a shutdown request and refresh
        its Date header: 0.23% of a core on an idle node, measured. A guest on a training
        node ticks once a second instead (shutdown within a second, Date refreshed each
        tick: ``on_tick`` refreshes when the counter is a multiple of 10)."""

        async def main_loop(self) -> None:
            counter = 0
            should_exit = await self.on_tick(counter)
            while not should_exit:
                counter = (counter + 10) % 864000
                await asyncio.sleep(SERVER_TICK_SECONDS)
                should_exit = await self.on_tick(counter)

    return QuietServer


class Service:
    """The daemon and its HTTP server, started and stopped together (``serve`` runs one
    until a signal; ``trainwatch run`` runs one beside the job it starts)."""

    def __init__(self, settings: Settings, job_output: Callable[[int], str] | None = None) -> None:
        self.settings = settings
        self.job_output = job_output
        self.url = ""
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen, start sampling and serving. Raises ConfigError for a bad --pid/--port."""
        import uvicorn

        from sidecar.daemon import Daemon
        from sidecar.doctor import checks, summary_line
        from sidecar.server import create_app

        settings = self.settings
        for pid in settings.pids:
            if not os.path.exists(f"{settings.proc_root}/{pid}"):
                raise ConfigError(f"--pid {pid}: no such process (give the pid of a running torchrun agent)")
        self._sock = _listen(settings)
        host, port = self._sock.getsockname()[:2]
        _prepare_postmortem_dir(settings.postmortem_dir)
        # the daemon subscribes to the connector itself and logs how that went
        log.info("%s", summary_line(checks(settings, connector=False)))
        self.daemon = Daemon(settings, job_output=self.job_output)
        config = uvicorn.Config(
            create_app(self.daemon),
            log_config=None,
            access_log=False,
            lifespan="on",
            log_level="debug" if settings.log_level == "DEBUG" else "warning",
            timeout_graceful_shutdown=5,
        )
        self.server = _quiet_server_class()(config)
        shown = host if ":" not in host else f"[{host}]"
        self.url = f"http://{shown}:{port}"

        def run_server() -> None:
            try:
                self.server.run(sockets=[self._sock])
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run_server, name="trainwatch-http")
        log.info(
            "trainwatch %s: watching %s every %gs; serving %s/metrics (also /ranks, /healthz)",
            __version__,
            f"agents {', '.join(map(str, settings.pids))}" if settings.pids else "every torchrun job",
            settings.interval_seconds,
            self.url,
        )
        self._thread.start()

    def wait(self) -> None:
        while not self._done.wait(0.5):
            pass

    def stop(self) -> bool:
        """Stop serving (the app's lifespan stops the daemon, which finishes postmortems in
        flight). True when the server had started."""
        self.server.should_exit = True
        self.wait()
        if self._thread is not None:
            self._thread.join()
        self._sock.close()
        return bool(self.server.started)


def serve(settings: Settings) -> int:
    """Run the daemon until SIGINT/SIGTERM. Returns the exit status."""
    service = Service(settings)
    service.start()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        service.server.should_exit = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    service.wait()
    if not service.stop():
        log.error("the HTTP server failed to start")
        return 1
    log.info("stopped")
    return 0


def postmortem_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """``trainwatch postmortem [ID|PATH|URL] [--format text|json] [--postmortem-dir DIR]``:
    print one postmortem. Without an argument: the newest in the postmortem directory,
    else the one a local daemon serves."""
    import json
    import urllib.error
    import urllib.request

    from sidecar.postmortem import ID_PATTERN, PostmortemStore, render_text

    env = os.environ if environ is None else environ
    p = _Parser(prog="trainwatch postmortem", description="Print a postmortem in the terminal.")
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

    from sidecar.diagnose import DiagnoseError, diagnose, read_inputs, render_diagnosis
    from sidecar.postmortem_html import render_html

    p = _Parser(
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
        sys.stdout.write(render_diagnosis(doc))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args:
            _parser().print_help(sys.stderr)
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
        _configure_logging(settings.log_level)
        return serve(settings)
    except ConfigError as exc:
        print(f"trainwatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
