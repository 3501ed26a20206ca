"""``trainwatch run [daemon options] -- torchrun ARGS...``: launch a job and watch it.

The zero-setup way: no daemon to deploy, no root needed for the basics. The command runs
as a child; everything it and its ranks print is passed to this terminal unchanged (a
pseudo-terminal when stdout is one, so ranks stay line-buffered and progress bars keep
working; separate pipes for stdout and stderr otherwise) and kept, bounded, as evidence.
The daemon watches only this job and serves the same HTTP; postmortems are written as
usual. The output also goes to a spool file named in the job's environment
(``TRAINWATCH_RUN_OUTPUT``), so that a daemon watching the whole node reads the same lines
through this process's descriptor and gives the same verdict. The exit status is the
command's (128+N when a signal N ended it).

Signals: Ctrl-C at a terminal reaches the command's process group directly, as without
trainwatch; a signal sent to trainwatch itself (``kill``, Slurm's ``scancel``, a
container's stop) is passed on to the command once. Ranks are in sessions of their own
(torchrun starts them so), so neither reaches them except through torchrun.

``--end-stranded-after DURATION`` (off by default): once ranks of the job have been stranded
that long (alive and making no progress after another rank died: ``stalls/stranded.py``),
run ends its own job: SIGTERM to the command and to every rank it watches (through pidfds, so
a pid reused meanwhile is never signalled), SIGKILL to what is left ``STRANDED_GRACE_S``
later; it then exits with ``ENDED_STRANDED``. The daemon itself never signals a job.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from sidecar import lognames
from sidecar.errors import ConfigError
from sidecar.model import ProcKey
from sidecar.settings import Settings

if TYPE_CHECKING:
    from sidecar.front.service import Service

__all__ = ["OutputKeeper", "run_command"]

log = logging.getLogger(lognames.FRONT)

KEEP_BYTES = 8 << 20  # the output kept as evidence: the last 8 MiB
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
SI_KERNEL = 0x80  # si_code of a signal the kernel generated (a terminal's Ctrl-C, Ctrl-\)
STRANDED_GRACE_S = 10.0  # --end-stranded-after: SIGTERM, then SIGKILL this much later
ENDED_STRANDED = 124  # the exit status when run ended a stranded job (as timeout(1) does)


class OutputKeeper:
    """The last ``limit`` bytes of what the command wrote, thread-safe; also appended to
    ``spool`` (a file descriptor) when given, which is cut back to the last ``limit`` bytes
    whenever it passes twice that."""

    def __init__(self, limit: int = KEEP_BYTES, spool: int | None = None) -> None:
        self.limit = limit
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._lock = threading.Lock()
        self.total = 0
        self._spool = spool
        self._spooled = 0

    def add(self, data: bytes) -> None:
        with self._lock:
            self._chunks.append(data)
            self._size += len(data)
            self.total += len(data)
            while self._size > self.limit and len(self._chunks) > 1:
                self._size -= len(self._chunks.popleft())
            if self._spool is not None:
                self._write_spool(self._spool, data)

    def _write_spool(self, fd: int, data: bytes) -> None:
        try:
            if self._spooled + len(data) > 2 * self.limit:
                os.ftruncate(fd, 0)
                kept = b"".join(self._chunks)[-self.limit :]
                os.write(fd, kept)
                self._spooled = len(kept)
            else:
                os.write(fd, data)
                self._spooled += len(data)
        except OSError as exc:  # a full disk never stops the job's output
            log.warning("trainwatch run: the output spool stopped (%s)", exc.strerror or exc)
            self._spool = None

    def text(self) -> str:
        with self._lock:
            data = b"".join(self._chunks)
        return data[-self.limit :].decode("utf-8", "replace")


def _pump(fd: int, out: int, keeper: OutputKeeper) -> None:
    """Copy ``fd`` to ``out`` as it comes, keeping a copy, until EOF (or EIO: a pty whose
    last writer closed)."""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        keeper.add(data)
        view = memoryview(data)
        while view:
            try:
                n = os.write(out, view)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            except OSError:
                break  # our own stdout is gone: keep draining so the job never blocks
            view = view[n:]
    with contextlib.suppress(OSError):
        os.close(fd)


def run_command(
    settings: Settings,
    command: Sequence[str],
    *,
    explicit_port: bool = False,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Start ``command`` and watch it with ``settings`` (parsed by the CLI from the options
    before ``--``; its help is ``verbs.RUN_HELP``). ``explicit_port``: the port was asked
    for (an option or TRAINWATCH_PORT), so a taken one is an error rather than replaced."""
    from sidecar.front.service import configure_logging

    env = dict(os.environ if environ is None else environ)
    command = list(command)
    configure_logging(settings.log_level)
    # Block the forwarded signals before any thread exists, so that one thread waits for
    # them (sigwaitinfo tells a terminal's Ctrl-C from a kill); the child unblocks them.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    tty = os.isatty(1)
    spool, spool_path = _open_spool(settings.postmortem_dir)
    keeper = OutputKeeper(spool=spool)
    child_env = dict(env, TRAINWATCH_RUN_OUTPUT=spool_path) if spool_path else env
    # Watching starts before the job does, for the agents below this process (the command,
    # or what it starts): a rank that dies in its first second is seen like any other. (Started
    # after the command, a daemon slowed by a loaded node attached too late to see it.)
    service = _start_watching(
        dataclasses.replace(settings, run_marker=spool_path), explicit_port, lambda _agent_pid: keeper.text()
    )
    # the postmortems already in the directory (earlier runs'): every later one is this job's,
    # as this daemon watches only the launchers below this process (the job's agent may be
    # the command itself, or below it: DeepSpeed's runner starts its launcher)
    earlier = {d["id"] for d in service.daemon.store.documents()} if service is not None else set()
    try:
        if tty:
            master, slave = os.openpty()
            with contextlib.suppress(OSError):
                fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(1, termios.TIOCGWINSZ, b"\0" * 8))
            child_out, child_err = slave, slave
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            child_out, child_err = out_w, err_w
        try:
            child = subprocess.Popen(
                command,
                stdout=child_out,
                stderr=child_err,
                env=child_env,
                preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED),
            )
        except OSError as exc:
            raise ConfigError(f"run: cannot start {command[0]}: {exc.strerror}") from None
    except BaseException:
        if service is not None:
            service.stop()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        raise
    pumps: list[threading.Thread] = []
    if tty:
        os.close(slave)
        pumps.append(threading.Thread(target=_pump, args=(master, 1, keeper), daemon=True))
    else:
        os.close(out_w)
        os.close(err_w)
        pumps.append(threading.Thread(target=_pump, args=(out_r, 1, keeper), daemon=True))
        pumps.append(threading.Thread(target=_pump, args=(err_r, 2, keeper), daemon=True))
    for p in pumps:
        p.start()

    def forward() -> None:
        while True:
            info = signal.sigwaitinfo(set(FORWARDED))
            if child.poll() is not None:
                return
            if info.si_code == SI_KERNEL and info.si_signo in (signal.SIGINT, signal.SIGQUIT):
                continue  # typed at the terminal: the command's process group got it too
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, info.si_signo)

    threading.Thread(target=forward, name="trainwatch-signals", daemon=True).start()
    ended = threading.Event()
    if service is not None and settings.end_stranded_after_seconds is not None:
        threading.Thread(
            target=_end_when_stranded,
            args=(service, child, settings.end_stranded_after_seconds, ended),
            name="trainwatch-stranded",
            daemon=True,
        ).start()
    code = child.wait()
    for p in pumps:
        p.join(5)  # ranks left behind may hold the output open: do not wait for them forever
    if service is not None:
        service.stop()  # finishes the postmortems in flight
        _report(service, earlier)
    if ended.is_set():
        return ENDED_STRANDED
    return 128 - code if code < 0 else code


def _end_when_stranded(
    service: Service, child: subprocess.Popen[bytes], after: float, ended: threading.Event
) -> None:
    """``--end-stranded-after``: look at the run's own snapshot every second; once a
    stranding has lasted ``after`` seconds, end the job."""
    while child.poll() is None:
        snap = service.daemon.snapshot
        jobs = snap.jobs if snap is not None else ()
        for job in jobs:
            s = job.stranded
            if s is None or time.time() - s.since < after:
                continue
            log.warning(
                "trainwatch run: job %s: rank(s) %s stranded for %.0f s after rank(s) %s died: "
                "ending the job (--end-stranded-after)",
                job.key,
                ", ".join(s.ranks),
                time.time() - s.since,
                ", ".join(s.dead_ranks),
            )
            ended.set()
            _end_job(child, [r.key for j in jobs for r in j.ranks])
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(1.0)


def _end_job(child: subprocess.Popen[bytes], ranks: list[ProcKey]) -> None:
    """SIGTERM to the command and the ranks, SIGKILL to what is left after the grace. A rank
    is signalled through a pidfd opened and then checked against its start time: never a
    process that took its pid since."""
    from sidecar.probes.proc import ProcReader

    reader = ProcReader()
    fds = []
    by_pid: list[ProcKey] = []  # a kernel without pidfds (before 5.3): by pid, checked just before
    for key in ranks:
        try:
            fd = os.pidfd_open(key.pid)
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                by_pid.append(key)
            continue  # else gone
        if reader.alive(key):
            fds.append(fd)
        else:
            os.close(fd)
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)
            for fd in fds:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, sig)
            for key in by_pid:
                if reader.alive(key):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(key.pid, sig)
            deadline = time.monotonic() + STRANDED_GRACE_S
            while time.monotonic() < deadline and (child.poll() is None or _any_alive(fds)):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(0.2)
            if child.poll() is not None and not _any_alive(fds):
                return
    finally:
        for fd in fds:
            os.close(fd)
        reader.close()


def _any_alive(fds: list[int]) -> bool:
    """Whether a process of these pidfds is still running (a pidfd polls readable once its
    process has exited)."""
    if not fds:
        return False
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return len(poller.poll(0)) < len(fds)


SPOOL_KEEP_S = 86_400.0  # spools of earlier runs are removed after a day


def _open_spool(postmortem_dir: str) -> tuple[int | None, str | None]:
    """A file for the job's output that a trainwatch daemon watching the node finds (the job's
    environment names it in TRAINWATCH_RUN_OUTPUT; the daemon reads it through this
    process's descriptor), so both give the same verdict: ``<postmortem dir>/spool/run-PID.out``,
    mode 0600. Earlier runs' spools older than a day go. (None, None) when it cannot be made:
    the job runs on without it."""
    directory = os.path.join(postmortem_dir, "spool")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        now = time.time()
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if name.startswith("run-") and now - os.lstat(path).st_mtime > SPOOL_KEEP_S:
                    os.unlink(path)
        path = os.path.join(directory, f"run-{os.getpid()}.out")
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError as exc:
        log.warning("trainwatch run: no output spool for a node's daemon (%s)", exc.strerror or exc)
        return None, None
    return fd, path


def _start_watching(
    settings: Settings, explicit_port: bool, job_output: Callable[[int], str]
) -> Service | None:
    """run's own daemon, started: the agents below this process, on the default port unless
    another trainwatch holds it (then a free one; not when the port was asked for). None when
    it cannot start: whatever breaks in trainwatch, the job it starts runs on."""
    from sidecar.front.service import Service

    mine = dataclasses.replace(settings, pids=(os.getpid(),))
    for attempt in (mine, dataclasses.replace(mine, port=0)):
        service = Service(attempt, job_output=job_output)
        try:
            service.start()
            return service
        except ConfigError as exc:
            # the port taken, by a daemon or another run starting at the same moment
            if str(exc).startswith("--port") and not explicit_port and attempt.port != 0:
                continue
            log.error("trainwatch run: not watching (%s); the job runs on", exc)
            return None
        except Exception:
            log.exception("trainwatch run: not watching; the job runs on")
            return None
    return None


def _report(service: Service, earlier: set[str]) -> None:
    """One line per postmortem of this job on stderr, after the job's own output: those
    written since the job started (``earlier``: the ids already there)."""
    docs = [d for d in service.daemon.store.documents() if d.get("id") not in earlier]
    for doc in docs:
        v, k = doc["victim"], doc["killer"]
        where = service.daemon.store.path_of(doc["id"]) or f"{service.url}/postmortems/{doc['id']}"
        sys.stderr.write(
            f"trainwatch: rank {v.get('rank')} (pid {v.get('pid')}): {k['kind']} ({k['confidence']}): "
            f"{k['summary']}\ntrainwatch: postmortem: trainwatch postmortem {where}\n"
        )
    sys.stderr.flush()
