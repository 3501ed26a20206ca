"""Helpers for end-to-end tests: the real daemon as a subprocess and real torchrun jobs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from prometheus_client.parser import text_string_to_metric_families

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]  # tests/support/e2e.py
WORKLOAD = REPO / "tests" / "workloads" / "rank.py"
SPAWNED = REPO / "tests" / "workloads" / "spawned.py"  # rank.py under torch.multiprocessing.spawn
LIGHTNING_JOB = REPO / "tests" / "workloads" / "lightning_job.py"  # rank.py under Lightning's launcher
TASK_JOB = REPO / "tests" / "workloads" / "task_job.py"  # rank.py under mpirun or srun
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")  # DeepSpeed's runner


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    for got, v in samples.get(name, []):
        if all(got.get(k) == want for k, want in labels.items()):
            return v
    return None


def _in_xdist_worker() -> bool:
    """Whether this process is a pytest-xdist worker (not merely a child of one, which
    inherits PYTEST_XDIST_WORKER: the worker's own pid is in its environment's marker)."""
    return os.environ.get("TRAINWATCH_XDIST_PID") == str(os.getpid())


class DaemonProc:
    """``python -m sidecar --attach-torchrun --port 0 ...`` with its log in a file."""

    def __init__(
        self,
        tmp: Path,
        *args: str,
        interval: float = 0.2,
        wrap: list[str] | None = None,
        cwd: Path | None = None,
        whole_machine: bool = False,
    ) -> None:
        """``cwd``: the tree whose ``sidecar`` runs (default this repository; a benchmark
        compares another commit's checkout side by side). ``whole_machine``: watch every job
        here even under pytest-xdist, for a launcher whose ranks are not below the test (a
        Slurm step's tasks are slurmd's); the test then finds its job by its agent.

        Under pytest-xdist (tests side by side, ``make test``) the daemon watches only the
        jobs below this worker (``--pid`` of the worker: the agents below a process), so that
        another test's job, its deaths and its postmortems never reach this test's daemon;
        a test that names its own ``--pid`` keeps it. Run alone (the isolated step, a
        developer's single file) it watches the whole machine, as a deployed daemon does."""
        if _in_xdist_worker() and "--pid" not in args and not whole_machine:
            args = (*args, "--pid", str(os.getpid()))
        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        cmd = [
            *(wrap or []),
            sys.executable,
            "-m",
            "sidecar",
            "--attach-torchrun",
            "--port",
            "0",
            "--interval",
            str(interval),
            "--postmortem-dir",
            str(tmp / "postmortems"),
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd or REPO)
        match = wait_for(
            lambda: re.search(r"serving (https?)://([\d.]+):(\d+)/metrics", self.log()),
            30,
            "the daemon to listen",
        )
        self.base = f"{match.group(1)}://{match.group(2)}:{match.group(3)}"
        self.port = int(match.group(3))

    def log(self) -> str:
        return self.log_path.read_text()

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> Samples:
        status, body = self.get("/metrics")
        assert status == 200
        return parse_metrics(body)

    def ranks(self) -> dict[str, Any]:
        return json.loads(self.get("/ranks")[1])

    def wait_sampled(
        self, job: TorchrunJob, pids: dict[int, list[int]], timeout: float = 30
    ) -> dict[str, Any]:
        """The job's entry in ``/ranks`` once every rank of ``pids`` (rank -> [rank pid,
        worker pids...], as ``TorchrunJob.ready`` gives) is attached and sampled with its
        whole tree: what "the daemon has seen the ranks" means before a test kills one."""
        want = {rank_pids[0]: len(rank_pids) for rank_pids in pids.values()}

        def seen() -> dict[str, Any] | None:
            for entry in self.ranks()["jobs"]:
                if entry["agent_pid"] != job.agent_pid:
                    continue
                got = {r["pid"]: r["tree_processes"] for r in entry["ranks"] if r["rss_bytes"]}
                return entry if all(got.get(pid, 0) >= n for pid, n in want.items()) else None
            return None

        return dict(wait_for(seen, timeout, f"the daemon to sample every rank of {job.dir.name}"))

    def samples_total(self) -> float:
        return value(self.metrics(), "trainwatch_samples_total") or 0.0

    def wait_rounds(self, rounds: int, timeout: float = 30) -> None:
        """Wait until the sampler has finished ``rounds`` more rounds than now."""
        start = self.samples_total()
        wait_for(lambda: self.samples_total() >= start + rounds, timeout, f"{rounds} sampling rounds")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def __enter__(self) -> DaemonProc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def nvml_stand_in(tmp: Path, monkeypatch: Any, **files: Path) -> None:
    """Build tests/workloads/nvml_shim.c into ``tmp/nvml/libnvidia-ml.so.1`` and make the
    daemons this test starts load it (the real bindings find it first); ``files`` name its
    control files by the shim's variable (``pids``: TRAINWATCH_SHIM_PIDS, ``lost``, ``busy``)."""
    lib = tmp / "nvml"
    lib.mkdir()
    shim = REPO / "tests" / "workloads" / "nvml_shim.c"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib / "libnvidia-ml.so.1"), str(shim)], check=True)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    for name, path in files.items():
        monkeypatch.setenv(f"TRAINWATCH_SHIM_{name.upper()}", str(path))


def job_postmortem(
    daemon: DaemonProc, victim_rank: int | None, want_fates: int, job: TorchrunJob, timeout: float = 60
) -> dict:
    """The postmortem of ``job`` once ``want_fates`` ranks' fates are known. (The daemon
    watches every job on the machine, so the newest postmortem may be another's.)
    ``victim_rank`` None: whichever rank the postmortem names."""

    def ready():
        status, body = daemon.get("/postmortems")
        if status != 200:
            return None
        for entry in json.loads(body):
            doc = json.loads(daemon.get(f"/postmortems/{entry['id']}")[1])
            if doc["job"]["agent_pid"] != job.agent_pid:
                continue
            decided = [r for r in doc["ranks"] if r["fate"] not in ("running", "unknown")]
            right = victim_rank is None or doc["victim"]["rank"] == victim_rank
            return doc if right and len(decided) >= want_fates else None
        return None

    try:
        return wait_for(ready, timeout, "the postmortem with every rank's fate", 0.2)
    except AssertionError as exc:
        status, body = daemon.get("/postmortem")
        raise AssertionError(
            f"{exc}\n/postmortem {status}: {body[:3000]}\ndaemon log:\n{daemon.log()[-4000:]}"
        ) from None


def settled_postmortem(
    daemon: DaemonProc, doc: dict, right: Callable[[dict], bool], timeout: float = 20
) -> dict:
    """``doc`` as the daemon rewrites it, once ``right`` holds of it: a launcher that relays
    its ranks' output (mpirun's pipes) writes a rank's last lines into its own log after
    the rank died, and the postmortem is rewritten with them when the launcher exits."""

    def now() -> dict | None:
        status, body = daemon.get(f"/postmortems/{doc['id']}")
        latest = json.loads(body) if status == 200 else None
        return latest if latest is not None and right(latest) else None

    try:
        return wait_for(now, timeout, "the postmortem rewritten with the launcher's relayed output", 0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{json.dumps(doc, indent=1)[:4000]}") from None


class TorchrunJob:
    """A real ``torchrun --standalone`` job of tests/workloads/rank.py (gloo on CPU).
    ``launcher`` picks the command line: ``torchrun``, ``run`` (python -m
    torch.distributed.run) or ``launch`` (the deprecated torch.distributed.launch)."""

    LAUNCHERS: ClassVar[dict[str, list[str]]] = {
        "torchrun": [TORCHRUN],
        "run": [sys.executable, "-m", "torch.distributed.run"],
        "launch": [
            sys.executable,
            "-W",
            "ignore::FutureWarning",
            "-m",
            "torch.distributed.launch",
            "--use-env",
        ],
    }

    def __init__(
        self,
        tmp: Path,
        name: str,
        *,
        nproc: int = 2,
        max_restarts: int = 0,
        wrap: list[str] | None = None,
        launcher: str = "torchrun",
        launcher_args: tuple[str, ...] = (),
        rdzv_id: str | None = None,
        nnodes: int = 1,
        rdzv_endpoint: str | None = None,
        rdzv_host: bool = False,
        mode: int | None = None,
        env: dict[str, str] | None = None,
        python: str | None = None,
        **workload: Any,
    ) -> None:
        """``rdzv_id``: a c10d rendezvous with this run id instead of ``--standalone``
        (whose run id is random): jobs that share it are one job's nodes; with ``nnodes``
        over 1 and one ``rdzv_endpoint``, one job's agents ("nodes") on this machine, the
        first of them hosting the rendezvous store."""
        args = self._prepare(tmp, name, nproc, mode, workload)
        if rdzv_id is None:
            rendezvous = ["--standalone"]
        else:
            rendezvous = [
                f"--nnodes={nnodes}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint or f'127.0.0.1:{free_port()}'}",
                f"--rdzv-id={rdzv_id}",
            ]
            if nnodes > 1:  # agents of one machine: one hosts the store, every one binds loopback
                rendezvous += [f"--rdzv-conf=is_host={int(rdzv_host)}", "--local-addr=127.0.0.1"]
        launch = list(self.LAUNCHERS[launcher])
        if python is not None:  # another interpreter (one another user may run): python -m ...
            launch = (
                [python, *launch[1:]] if launcher != "torchrun" else [python, "-m", "torch.distributed.run"]
            )
        cmd = [
            *launch,
            *rendezvous,
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1",
            *launcher_args,
            str(WORKLOAD),
            *args,
        ]
        self._start(cmd, wrap, env or {})

    def _prepare(
        self, tmp: Path, name: str, nproc: int, mode: int | None, workload: dict[str, Any]
    ) -> list[str]:
        """The job's folder (its ready files, its stop file, its output) and the workload's
        arguments."""
        self.dir = tmp / name
        self.dir.mkdir(parents=True)
        if mode is not None:  # a job run as another user writes its ready files here
            self.dir.chmod(mode)
        self.stop_file = self.dir / "stop"
        self.nproc = nproc
        args = [f"--ready-dir={self.dir}", f"--stop-file={self.stop_file}"]
        return args + [f"--{k.replace('_', '-')}={v}" for k, v in workload.items()]

    def _start(self, cmd: list[str], wrap: list[str] | None, env: dict[str, str]) -> None:
        """Start the launcher's command (behind ``wrap``), its output to the job's folder."""
        if wrap:
            cmd = [*wrap, *cmd]
        self._out = open(self.dir / "torchrun.log", "w")  # noqa: SIM115
        run_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, cwd=REPO, env=run_env)

    @property
    def agent_pid(self) -> int:
        return self.proc.pid

    def ready(self, restart: int = 0, timeout: float = 120) -> dict[int, list[int]]:
        """rank -> [rank pid, worker pids...] once every rank of that attempt is set up."""

        def read() -> dict[int, list[int]] | None:
            # this node's ranks (0..nproc-1 on one node; any global ranks on one of several)
            files = sorted(self.dir.glob(f"rank*.r{restart}"))
            if self.proc.poll() is not None and restart == 0:
                raise AssertionError(f"torchrun exited early:\n{(self.dir / 'torchrun.log').read_text()}")
            if len(files) < self.nproc:
                return None
            return {int(f.name[4:].split(".")[0]): [int(p) for p in f.read_text().split()] for f in files}

        return wait_for(read, timeout, f"job {self.dir.name} attempt {restart} to be ready", 0.2)

    def output(self) -> str:
        """What the launcher and its ranks printed so far (torchrun.log), read here."""
        return (self.dir / "torchrun.log").read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        self.stop_file.touch()
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.close()

    def __enter__(self) -> TorchrunJob:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop_file.touch()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                # workers are session leaders of their own: kill them by name, then the agent
                for pid in descendants(self.proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


class AgentIsRanksParent:
    """A job whose launching process is not the command the test started (a process that
    starts, its ranks' parent): read when the ranks are first ready, while they run."""

    _agent: int | None = None

    def ready(self, restart: int = 0, timeout: float = 120) -> dict[int, list[int]]:
        ranks = super().ready(restart, timeout)  # type: ignore[misc]
        if self._agent is None:
            self._agent = parent_pid(ranks[0][0])
        return ranks

    @property
    def agent_pid(self) -> int:
        if self._agent is None:
            self.ready()
        assert self._agent is not None
        return self._agent


class LaunchedJob(TorchrunJob):
    """A real job of tests/workloads/rank.py under another launcher: ``command`` gives its
    command line for ``nproc`` ranks and the workload's arguments, ``ENV`` what it adds to
    the environment. The launcher's own process is ``self.proc``, the job's launching
    process ``agent_pid`` unless the launcher says otherwise."""

    ENV: ClassVar[dict[str, str]] = {}
    LAUNCHER: ClassVar[str] = ""  # the launcher trainwatch names it

    def __init__(
        self,
        tmp: Path,
        name: str,
        *,
        nproc: int = 2,
        wrap: list[str] | None = None,
        env: dict[str, str] | None = None,
        **workload: Any,
    ) -> None:
        args = self._prepare(tmp, name, nproc, None, workload)
        self._start(self.command(nproc, args), wrap, {**self.ENV, **(env or {})})

    def command(self, nproc: int, args: list[str]) -> list[str]:
        raise NotImplementedError


class DeepSpeedJob(LaunchedJob):
    """DeepSpeed's own launcher, as its users start it: ``deepspeed --num_gpus N script``
    (gloo on CPU: ``DS_ACCELERATOR=cpu``). The runner (``self.proc``) starts the per-node
    launcher, which starts the ranks; the launcher is the job's launching process."""

    ENV: ClassVar[dict[str, str]] = {"DS_ACCELERATOR": "cpu"}
    LAUNCHER = "deepspeed"
    LOCAL_RANK_ARG: ClassVar[bool] = False  # DeepSpeed's default passes --local_rank=N to each rank
    _launcher: int | None = None

    def command(self, nproc: int, args: list[str]) -> list[str]:
        # --no_local_rank: rank.py reads LOCAL_RANK from its environment (it accepts the
        # argument too, as DeepSpeed's default gives it)
        return [
            DEEPSPEED,
            f"--num_gpus={nproc}",
            *([] if self.LOCAL_RANK_ARG else ["--no_local_rank"]),
            f"--master_port={free_port()}",
            str(WORKLOAD),
            *args,
        ]

    @property
    def agent_pid(self) -> int:
        """The per-node launcher (``python -u -m deepspeed.launcher.launch``), below the runner."""
        if self._launcher is None:

            def launcher() -> int | None:
                for pid in descendants(self.proc.pid):
                    with contextlib.suppress(OSError):
                        if b"deepspeed.launcher.launch" in Path(f"/proc/{pid}/cmdline").read_bytes():
                            return pid
                return None

            self._launcher = int(wait_for(launcher, 60, "DeepSpeed's per-node launcher"))
        return self._launcher


class AccelerateJob(LaunchedJob):
    """``accelerate launch --multi_gpu --num_processes N script`` (Hugging Face accelerate):
    it runs torch's elastic agent in its own process (``torch.distributed.run.run``), which
    names itself ``pt_elastic``: a torchrun job whatever its command line. On CPU the ranks
    use gloo (rank.py's own choice)."""

    LAUNCHER = "torchrun"

    def command(self, nproc: int, args: list[str]) -> list[str]:
        return [
            str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu",
            f"--num_processes={nproc}", "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
            f"--main_process_port={free_port()}", str(WORKLOAD), *args,
        ]  # fmt: skip


class SpawnJob(LaunchedJob):
    """``torch.multiprocessing.spawn`` (tests/workloads/spawned.py): the script that calls
    spawn is the job's launching process, each spawned child a rank that sets its identity in
    its own ``os.environ``."""

    LAUNCHER = "spawn"

    def command(self, nproc: int, args: list[str]) -> list[str]:
        return [sys.executable, str(SPAWNED), f"--nprocs={nproc}", f"--port={free_port()}", *args]


class LightningJob(LaunchedJob):
    """Lightning's own launcher (tests/workloads/lightning_job.py: Fabric, strategy "ddp",
    CPU): the script is rank 0 and the job's launching process; it re-runs itself for rank 1."""

    LAUNCHER = "lightning"

    def command(self, nproc: int, args: list[str]) -> list[str]:
        return [sys.executable, str(LIGHTNING_JOB), f"--devices={nproc}", *args]


class MpiJob(LaunchedJob):
    """Open MPI's ``mpirun -np N`` (tests/workloads/task_job.py): mpirun is the job's
    launching process, its children the ranks."""

    LAUNCHER = "mpi"

    def command(self, nproc: int, args: list[str]) -> list[str]:
        # by its own name: where MPICH is installed beside it, ``mpirun`` may be either
        return [
            "mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
            "-np", str(nproc), sys.executable, str(TASK_JOB), f"--port={free_port()}", *args,
        ]  # fmt: skip


class MpichJob(AgentIsRanksParent, LaunchedJob):
    """MPICH's ``mpiexec -n N`` (Hydra): mpiexec starts one ``hydra_pmi_proxy`` per node,
    the job's launching process, whose children are the ranks (PMI_RANK; MPICH gives them
    no job id)."""

    LAUNCHER = "mpi"

    def command(self, nproc: int, args: list[str]) -> list[str]:
        return [
            "mpiexec.mpich",
            "-n",
            str(nproc),
            sys.executable,
            str(TASK_JOB),
            f"--port={free_port()}",
            *args,
        ]


class SlurmJob(AgentIsRanksParent, TorchrunJob):
    """A real step of tests/workloads/task_job.py on the test Slurm (tests/support/slurm.py): ``srun
    --nodes=K -n N --mem=M``. The step's slurmstepd on a node, which slurmd starts, is the
    job's launching process there (``agent_pid``: rank 0's parent), not srun."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        *,
        nproc: int = 2,
        nodes: int = 1,
        mem: str = "1536M",
        kill_on_bad_exit: bool = True,
        env: dict[str, str] | None = None,
        **workload: Any,
    ) -> None:
        from tests.support import slurm

        self.slurm_env = slurm.cluster()
        args = self._prepare(tmp, name, nproc, None, workload)
        cmd = [
            "srun", f"--nodes={nodes}", f"--ntasks={nproc}", f"--mem={mem}",
            f"--kill-on-bad-exit={int(kill_on_bad_exit)}", f"--job-name=tw-{name}",
            sys.executable, str(TASK_JOB), f"--port={free_port()}", *args,
        ]  # fmt: skip
        self._start(cmd, None, {**(env or {}), "SLURM_CONF": self.slurm_env["SLURM_CONF"]})

    def cancel(self) -> None:
        """End the step (scancel of its job), as its user would."""
        subprocess.run(["scancel", f"--name=tw-{self.dir.name}"], env=self.slurm_env, check=False, timeout=30)

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.cancel()
        super().__exit__(*exc)


def oom_killed(pid: int) -> bool:
    """Whether the kernel's log (read here, not through trainwatch) records an OOM kill of
    ``pid``: every record in /dev/kmsg's buffer, read without blocking."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                return False
            except OSError:  # a record overwritten while read (EPIPE): go on
                continue
            if f"Killed process {pid} " in record:
                return True
    finally:
        os.close(fd)


# what gloo prints when a peer's process is gone (its transport's own words, any version)
_PEER_GONE = re.compile(r"gloo/transport|Connection (?:closed|reset) by peer")


def survivor_fate_right(row: dict, output: str | None = None) -> bool:
    """A survivor's fate (its row in the postmortem) after another rank's death, checked
    against how it ended: SIGTERMed (or SIGKILLed) by its launcher, terminated_by_agent; or,
    when its collective failed first for the peer that died (gloo: the connection closed),
    an exit of its own that its output ties to that death, same_cause. Which comes first is
    a race (DeepSpeed's launcher polls its ranks every second, torchrun's every
    --monitor-interval; a loaded machine delays either); each outcome has its word. A
    survivor the kernel's OOM killer took next (its own record in the kernel's log) died of
    the same cause. ``output``: the job's output as the test read it (not through trainwatch);
    given, a same_cause exit must show gloo's report of the peer that went away there."""
    if row["signal"] == "SIGKILL" and oom_killed(row["pid"]):  # the OOM killer took it next
        return bool(row["fate"] == "same_cause")
    if row["signal"] in ("SIGTERM", "SIGKILL"):
        return bool(row["fate"] == "terminated_by_agent")
    if output is not None and not _PEER_GONE.search(output):
        return False
    return row["exit_code"] not in (0, None) and row["fate"] == "same_cause"


def python_for_user(uid: int) -> tuple[str, str] | None:
    """An interpreter of this Python version that user ``uid`` may execute, and the
    PYTHONPATH that gives it this environment's packages (torch): (python, pythonpath).
    The test environment's own interpreter may live where only root can reach it."""
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            out = subprocess.run(
                ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", candidate, "-c",
                 # the agent starts its workers with sys.executable: that must work too
                 "import subprocess, sys, torch; subprocess.run([sys.executable, '-c', ''], check=True); "
                 "print(sys.version_info[:2])"],
                capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=site), cwd="/",
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == str(sys.version_info[:2]):
            return candidate, site
    return None


def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@contextlib.contextmanager
def less_host_memory(leave_bytes: int) -> Any:
    """Hold back all but about ``leave_bytes`` of the memory available now, for a real
    global OOM that need not fill the whole machine: the kernel's huge page pool
    (/proc/sys/vm/nr_hugepages) is grown by that much, and the pages it holds are taken
    from the free memory every other allocation uses (reserving them touches nothing,
    unlike filling it, which on a virtual machine runs at the speed the host backs fresh
    pages). The pool is given back to its size before, whatever happens. Where the pool
    cannot grow (no hugetlb, no root, fragmented memory) less or nothing is held back and
    the OOM simply comes later. Yields the bytes held back."""
    knob = Path("/proc/sys/vm/nr_hugepages")
    lines = Path("/proc/meminfo").read_text().splitlines()
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines}
    page = meminfo.get("Hugepagesize", 0)
    before = None
    try:
        before = int(knob.read_text())
        want = max(0, (meminfo["MemAvailable"] - leave_bytes) // page) if page else 0
        if want:
            knob.write_text(str(before + want))
    except (OSError, ValueError):
        before = None
    try:
        held = (int(knob.read_text()) - before) * page if before is not None else 0
        yield held
    finally:
        if before is not None:
            knob.write_text(str(before))
