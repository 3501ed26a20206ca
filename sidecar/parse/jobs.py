"""What schedulers, containers, launchers and shells say when a training process ends. Pure.
(These are lines of a log; the jobs the daemon finds and tracks live are ``sampling/jobs.py``.)

Each line in, a ``JobRecord`` or None out. Formats, as they appear in real logs:

* Slurm: ``slurmstepd: error: Detected 1 oom-kill event(s) in StepId=191.batch cgroup.``
  (20.02+; ``in step 191.batch cgroup`` before), ``Job 1234 exceeded memory limit (X > Y),
  being killed`` (jobacct_gather's polling kill, OverMemoryKill: slurmstepd's own policy, not
  the kernel's), ``srun: error: node7: task 3:
  Out Of Memory``, ``OUT_OF_MEMORY`` (``sacct``, ``scontrol``; ``OUT_OF_ME+`` when sacct
  cuts the column), ``*** JOB 123 ON node7 CANCELLED AT 2026-12-02T11:53:34 DUE TO TIME
  LIMIT ***`` (also ``PREEMPTION``, ``NODE FAILURE``, or by a user);
* Kubernetes (``kubectl describe pod``, events, the pod JSON): ``Reason: OOMKilled``,
  ``Exit Code: 137``, ``The node was low on resource: memory.`` with ``Evicted``;
* Docker: ``"OOMKilled": true`` (``docker inspect``), ``exited with code 137`` (compose),
  ``Exited (137)`` (``docker ps``);
* Ray's memory monitor: ``... killed due to memory pressure (OOM)``, ``Task was killed due to
  the node running low on memory``; its generic ``Worker unexpectedly exits`` decides nothing;
* DeepSpeed's launcher: ``[launch.py:318:sigkill_handler] Killing subprocess 80``, ``[...,
  '--local_rank=1'] exits with return code = -9``, and its ``CPU Virtual Memory:  used =
  28.43 GB, percent = 22.6%`` readings;
* torch.distributed.launch before elastic, accelerate and other subprocess launchers:
  ``subprocess.CalledProcessError: Command '[...]' died with <Signals.SIGSEGV: 11>.`` or
  ``... returned non-zero exit status 1.``;
* shells: ``line 28:  8156 Killed   python3 main.py`` (bash, with the pid), a bare ``Killed``
  (and its translations: ``已杀死``, ``Getötet``...), ``Segmentation fault (core dumped)``.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass

__all__ = ["JobRecord", "parse_job_line", "parse_job_lines"]


@dataclass(frozen=True, slots=True)
class JobRecord:
    """``what``: oom_cgroup (a scheduler or runtime says a memory limit killed), memory_policy
    (a scheduler's own memory polling killed it: Slurm's jobacct_gather), eviction
    (Kubernetes evicted the pod for node memory pressure), memory_monitor (Ray's), time_limit,
    preempted, node_failure, cancelled, exit_signal, exit_code, killed_by_shell (a shell
    reports its child's death by a signal), teardown (a launcher killing its workers),
    spawned (a launcher starting a worker: its pid, and its local rank where the command
    says it),
    memory_usage (a host-memory reading), worker_died (a launcher's generic report)."""

    source: str
    what: str
    line: str
    pid: int | None = None
    signal: int | None = None
    exit_code: int | None = None
    local_rank: int | None = None
    scope: str | None = None  # the step, container or node the record names
    value: float | None = None  # memory_usage: percent of host memory used
    tasks: tuple[int, ...] = ()  # srun: the task ids the line reports (``tasks 0,2-3``), in order


def _sig(name: str) -> int | None:
    try:
        return int(_signal.Signals[name])
    except KeyError:
        return None


# slurmstepd's task/cgroup: "Detected N oom-kill event(s) in step J.S cgroup." (18.08 - 20.02),
# "... in StepId=J.S cgroup." / "... in StepId=J.S." (20.11 - 22.05), "Detected N oom_kill
# event(s) in StepId=J.S. Some of the step tasks have been OOM Killed." (23.02 on; the
# catalog's slurm.oom_kill_event*)
_SLURM_OOM = re.compile(
    r"Detected (\d{1,20}) oom[-_ ]kill events?(?:\(s\))? in (?:StepId=|JobId=|step )?"
    r"(\S+?)(?: cgroup|\.?$|\s)"
)
_SLURM_LIMIT = re.compile(
    r"(?:Job|Step) (\S+) exceeded (?:job )?memory limit(?: \((\d{1,20}) > (\d{1,20})\))?"
)
_SRUN_OOM = re.compile(r"srun: error: (\S+): task (\d{1,20}): Out Of Memory")
_SRUN_KILLED = re.compile(
    r"srun: error: (\S+): tasks? ([\d,-]+): (Killed|Terminated|Segmentation fault|Aborted)"
)
_SRUN_EXITED = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): Exited with exit code (\d{1,10})")
_MAX_TASKS = 65536  # a task list longer than any step's is no list srun printed
_SLURM_STATE = re.compile(r"\bOUT_OF_ME(?:MORY|\+)|JobState=OUT_OF_MEMORY|Reason=OutOfMemory")
_SLURM_CANCEL = re.compile(
    r"\*\*\* (?:JOB|STEP) (\S+) ON (\S+) CANCELLED AT (\S+)(?: DUE TO (TIME LIMIT|PREEMPTION|NODE FAILURE))?"
)
_K8S_OOM = re.compile(r"(?:Reason|reason)\"?:\s*\"?OOMKilled|\bOOMKilled\b(?!\"?:\s*false)")
_K8S_EVICTED = re.compile(r"[Tt]he node was low on resource: (memory|ephemeral-storage|\w+)")
_K8S_EXIT = re.compile(r"Exit Code:\s+(\d{1,20})")
_DOCKER_OOM = re.compile(r"\"OOMKilled\":\s*true")
_DOCKER_EXIT = re.compile(r"exited with code (\d{1,20})|\bExited \((\d{1,20})\)")
_RAY_OOM = re.compile(
    r"killed due to memory pressure \(OOM\)|node running low on memory|ray\.exceptions\.OutOfMemoryError|"
    r"exceeds the memory usage threshold"
)
_RAY_DIED = re.compile(r"Worker unexpectedly exits|The actor is dead because its worker process has died")
_DS_KILLING = re.compile(r"sigkill_handler\] Killing subprocess (\d{1,20})")
# deepspeed/launcher/launch.py main(): logger.info(f"process {process.pid} spawned with command: {cmd}")
_DS_SPAWNED = re.compile(r"launch\.py:\d{1,6}:main\] process (\d{1,20}) spawned with command: (\[.*\])")
_DS_EXITS = re.compile(r"sigkill_handler\] (\[.*\]) exits with return code = (-?\d{1,20})")
_DS_MEMORY = re.compile(r"CPU Virtual Memory:\s+used = ([\d.]+) GB, percent = ([\d.]+)%")
_CALLED = re.compile(
    r"CalledProcessError: Command (.*?) "
    r"(?:died with <Signals\.(SIG\w+): (\d{1,20})>|returned non-zero exit status (-?\d{1,20}))"
)
_LOCAL_RANK = re.compile(r"--local[_-]rank[= ',]+(\d{1,20})")
_SHELL = re.compile(
    r"(?:line \d+:\s+)?(\d{1,20}) (Killed|Terminated|Segmentation fault|Bus error|Aborted)"
    r"(?: \(core dumped\))?\s+(\S.*)$"
)
# bash's message for a foreground child killed by a signal, in the locales seen in the wild
_BARE = {
    "Killed": "SIGKILL",
    "已杀死": "SIGKILL",
    "Getötet": "SIGKILL",
    "Processus arrêté": "SIGKILL",
    "強制終了": "SIGKILL",
    "Убито": "SIGKILL",
    "Terminated": "SIGTERM",
    "已终止": "SIGTERM",
    "Segmentation fault": "SIGSEGV",
    "段错误": "SIGSEGV",
    "Bus error": "SIGBUS",
    "总线错误": "SIGBUS",
    "Aborted": "SIGABRT",
    "已放弃": "SIGABRT",
}
_SHELL_SIGNALS = {
    "Killed": "SIGKILL",
    "Terminated": "SIGTERM",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Aborted": "SIGABRT",
}
_CORE = re.compile(r"\s*\((?:core dumped|核心已转储|Speicherabzug geschrieben)\)$")


def srun_tasks(text: str) -> tuple[int, ...]:
    """srun's task list (``0,2-3``) as task ids in order; empty when it is malformed or
    longer than any step."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return ()
        first, last = int(lo), int(hi or lo)
        if last < first or len(out) + last - first + 1 > _MAX_TASKS:
            return ()
        out += range(first, last + 1)
    return tuple(out)


# srun's own report starts again mid-line where a paste glued it to slurmstepd's
_SRUN_REPORT = re.compile(r"(?=\bsrun: error: )")


def parse_job_lines(text: str) -> list[JobRecord]:
    """The records of one line: slurmstepd's and srun's reports glued into one line by a paste
    (``... OOM Killed. srun: error: node: task 0: Out Of Memory``) are each read."""
    parts = [part for part in _SRUN_REPORT.split(text) if part.strip()] if "srun: error: " in text else [text]
    return [rec for part in parts if (rec := parse_job_line(part)) is not None]


def parse_job_line(text: str) -> JobRecord | None:
    line = text.strip()
    if not line:
        return None
    if "oom" in line.lower() and "kill event" in line:
        m = _SLURM_OOM.search(line)
        if m:
            return JobRecord("slurm", "oom_cgroup", line, scope=m[2].rstrip("."))
    m = _SLURM_LIMIT.search(line)
    if m:  # jobacct_gather's polling found the step over its limit and slurmstepd kills it
        return JobRecord("slurm", "memory_policy", line, scope=m[1])
    m = _SRUN_OOM.search(line)
    if m:
        return JobRecord("slurm", "oom_cgroup", line, local_rank=int(m[2]), scope=m[1], tasks=(int(m[2]),))
    m = _SRUN_KILLED.search(line) or _SRUN_EXITED.search(line)
    if m:
        task, tasks = m[2], srun_tasks(m[2])
        code = m[3] if m.re is _SRUN_EXITED else None
        return JobRecord(
            "slurm",
            "exit_code" if code is not None else "exit_signal",
            line,
            signal=None if code is not None else _sig(_SHELL_SIGNALS[m[3]]),
            exit_code=int(code) if code is not None else None,
            local_rank=int(task) if task.isdigit() else None,
            scope=m[1],
            tasks=tasks,
        )
    m = _SLURM_CANCEL.search(line)
    if m:
        what = {"TIME LIMIT": "time_limit", "PREEMPTION": "preempted", "NODE FAILURE": "node_failure"}
        return JobRecord("slurm", what.get(m[4] or "", "cancelled"), line, scope=m[1])
    if _SLURM_STATE.search(line):
        return JobRecord("slurm", "oom_cgroup", line)
    if _DOCKER_OOM.search(line):
        return JobRecord("docker", "oom_cgroup", line)
    if _K8S_OOM.search(line):
        return JobRecord("kubernetes", "oom_cgroup", line)
    m = _K8S_EVICTED.search(line)
    if m:
        return JobRecord("kubernetes", "eviction" if m[1] == "memory" else "cancelled", line, scope=m[1])
    m = _K8S_EXIT.search(line)
    if m:
        code = int(m[1])
        return JobRecord(
            "kubernetes", "exit_code", line, exit_code=code, signal=code - 128 if code > 128 else None
        )
    m = _DOCKER_EXIT.search(line)
    if m:
        code = int(m[1] or m[2])
        return JobRecord(
            "docker", "exit_code", line, exit_code=code, signal=code - 128 if code > 128 else None
        )
    if _RAY_OOM.search(line):
        return JobRecord("ray", "memory_monitor", line)
    if _RAY_DIED.search(line):
        return JobRecord("ray", "worker_died", line)
    m = _DS_KILLING.search(line)
    if m:
        return JobRecord("deepspeed", "teardown", line, pid=int(m[1]))
    m = _DS_SPAWNED.search(line)
    if m:
        lr = _LOCAL_RANK.search(m[2])
        return JobRecord("deepspeed", "spawned", line, pid=int(m[1]), local_rank=int(lr[1]) if lr else None)
    m = _DS_EXITS.search(line)
    if m:
        code = int(m[2])
        lr = _LOCAL_RANK.search(m[1])
        return JobRecord(
            "deepspeed",
            "exit_signal" if code < 0 else "exit_code",
            line,
            signal=-code if code < 0 else None,
            exit_code=code if code >= 0 else None,
            local_rank=int(lr[1]) if lr else None,
        )
    m = _DS_MEMORY.search(line)
    if m:
        return JobRecord("deepspeed", "memory_usage", line, value=float(m[2]))
    m = _CALLED.search(line)
    if m:
        lr = _LOCAL_RANK.search(m[1])
        local = int(lr[1]) if lr else None
        if m[3]:
            return JobRecord("launcher", "exit_signal", line, signal=int(m[3]), local_rank=local)
        return JobRecord("launcher", "exit_code", line, exit_code=int(m[4]), local_rank=local)
    m = _SHELL.search(line)
    if m:
        return JobRecord("shell", "killed_by_shell", line, pid=int(m[1]), signal=_sig(_SHELL_SIGNALS[m[2]]))
    bare = _CORE.sub("", line)
    if bare in _BARE:
        return JobRecord("shell", "killed_by_shell", line, signal=_sig(_BARE[bare]))
    return None
