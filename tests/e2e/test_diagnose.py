"""`trainwatch diagnose` on logs of real deaths produced here, with no daemon running: a rank
killed with kill -9 from outside, a cgroup OOM in a pid namespace, a DeepSpeed rank's OOM, Slurm
steps, Open MPI's tagged output, store timeouts, launchers' time limits. The diagnose of a real
cgroup OOM under torchrun (the kernel's own records, read back with dmesg in two styles) is one
view of that death in tests/e2e/scenarios/test_cgroup_oom.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup
from tests.support import slurm
from tests.support.e2e import REPO, TASK_JOB, DeepSpeedJob, TorchrunJob, free_port, survivor_fate_right
from tests.support.runs import diagnose_cli, kernel_dmesg, kernel_dmesg_since, kmsg_mark
from tests.support.skips import requires

GIB = 1 << 30
LOADER_OOM = REPO / "tests" / "workloads" / "loader_oom.py"


def _pasted(paste: Path, text: str) -> dict:
    """``text`` written to ``paste`` as a user would save it, and diagnose's JSON document of it
    (diagnose itself must have succeeded)."""
    paste.write_text(text)
    rc, out, err = diagnose_cli("--format", "json", str(paste))
    assert rc == 0, err[-3000:]
    return json.loads(out)


@pytest.mark.root
@requires("kmsg", "kmsg-write")
def test_a_real_kill_9_diagnosed_with_and_without_the_kernel_log(tmp_path):
    mark = kmsg_mark("a kill -9 to diagnose")
    with TorchrunJob(tmp_path, "kill9", hold_mb=50, workers=0) as job:
        pids = job.ready()
        os.kill(pids[1][0], 9)
        assert job.proc.wait(60) != 0
    log = str(job.dir / "torchrun.log")
    rc, out, _ = diagnose_cli("--format", "json", log)
    doc = json.loads(out)
    # the agent's log says only -9: the honest answer is unknown, with what to collect
    assert rc == 0 and (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("unknown", "possible")
    assert doc["victim"]["pid"] == pids[1][0] and any("dmesg" in c for c in doc["collect"])
    dmesg = tmp_path / "dmesg.txt"
    dmesg.write_text(kernel_dmesg_since(mark))  # this test's time: the node's log of the death
    rc, out, _ = diagnose_cli("--format", "json", log, str(dmesg))
    doc = json.loads(out)
    # the kernel log names no OOM for that pid: a kill from outside, at most "possible"
    assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("external_signal", "possible"), doc[
        "killer"
    ]
    rows = {r["pid"]: r for r in doc["ranks"]}
    assert set(rows) == {pids[1][0], pids[0][0]} and rows[pids[1][0]]["fate"] == "root_cause", rows
    assert survivor_fate_right(rows[pids[0][0]], job.output()), rows


@pytest.mark.root
@requires("memcg", "kmsg")
def test_a_real_cgroup_oom_in_a_pid_namespace_is_tied_by_the_command_s_name(tmp_path):
    """As in a container: the shell that ran the job lives in its own pid namespace and
    names its own pid for the process; the host's kernel log names the host's. The shell's
    report and the kernel's kill agree on the command's name only, and only one OOM kill
    has that name: the verdict ties them (likely at most: a name, not a pid)."""
    script = tmp_path / "train.sh"
    grow = "import time\nb=[]\nwhile True:\n    b.append(bytearray(64 << 20)); time.sleep(0.01)\n"
    (tmp_path / "grow.py").write_text(grow)
    script.write_text(f"#!/bin/bash\necho started\npython3 {tmp_path / 'grow.py'}\necho after $?\n")
    script.chmod(0o755)
    with memory_cgroup(256 << 20, "trainwatch-ns") as (_version, _parent, child):
        run = subprocess.run(
            [*join_cgroup(child), "unshare", "--pid", "--fork", "--mount-proc", str(script)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    shell = run.stdout + run.stderr
    told = re.search(r"line 3: +(\d+) Killed +python3 ", shell)
    assert told is not None, shell  # bash's own report, with the namespace's pid
    inner = int(told[1])
    deadline = time.monotonic() + 10
    kills: list[tuple[int, str]] = []
    while time.monotonic() < deadline:
        kills = [(int(m[1]), m[2]) for m in re.finditer(r"Killed process (\d+) \(([^)]*)\)", kernel_dmesg())]
        if kills and kills[-1][1] == "python3":
            break
        time.sleep(0.2)
    host = kills[-1][0]
    assert kills[-1][1] == "python3" and host != inner, kills[-3:]
    # only this death's kernel records: other tests' OOM kills of python3 would (rightly)
    # make the name ambiguous
    records = [
        line for line in kernel_dmesg().splitlines() if str(host) in line or "invoked oom-killer" in line
    ]
    (tmp_path / "shell.txt").write_text(shell)
    (tmp_path / "dmesg.txt").write_text("\n".join(records[-40:]))
    rc, out, err = diagnose_cli("--format", "json", str(tmp_path / "shell.txt"), str(tmp_path / "dmesg.txt"))
    assert rc == 0, err
    doc = json.loads(out)
    k = doc["killer"]
    assert k["kind"] == "cgroup_oom" and k["confidence"] in ("likely", "possible"), k
    assert f"pid {host} (python3)" in k["summary"] and f"pid {inner}" in k["summary"], k["summary"]
    # a second OOM kill of another python3 makes the name ambiguous: no tie
    other = re.sub(rf"\b{host}\b", str(host + 1), "\n".join(records[-40:]))
    (tmp_path / "dmesg2.txt").write_text("\n".join(records[-40:]) + "\n" + other)
    rc, out, _ = diagnose_cli("--format", "json", str(tmp_path / "shell.txt"), str(tmp_path / "dmesg2.txt"))
    assert json.loads(out)["killer"]["kind"] != "cgroup_oom", out


class _DeepSpeedLocalRank(DeepSpeedJob):
    LOCAL_RANK_ARG = True  # DeepSpeed's default: each rank's command line says its local rank


@pytest.mark.root
@requires("deepspeed", "memcg", "kmsg")
def test_a_deepspeed_rank_s_oom_is_tied_by_the_pid_its_launcher_spawned(tmp_path):
    """DeepSpeed's launcher logs each worker's pid as it starts it (``process N spawned
    with command: [... '--local_rank=1' ...]``) and, at the end, the failed worker's local
    rank only (``[... '--local_rank=1' ...] exits with return code = -9``). Joined, the
    kernel's record of that pid is the rank's: certain, no longer a guess from there being
    one OOM kill in the log."""
    with (
        memory_cgroup(int(1.5 * GIB), "trainwatch-ds-diag") as (_version, _parent, child),
        _DeepSpeedLocalRank(
            # handoff: rank 0 waits on the store, in no collective, so it outlives rank 1 and
            # the launcher's one exit line is rank 1's (it reports the first exit it polls)
            tmp_path,
            "ds-oom",
            wrap=join_cgroup(child),
            hold_mb=50,
            workers=0,
            grow_rank=1,
            grow_after=2,
            handoff=1,
        ) as job,
    ):
        pids = job.ready()
        assert job.proc.wait(120) != 0
    victim = pids[1][0]
    log = (job.dir / "torchrun.log").read_text()
    assert f"process {victim} spawned with command" in log and "exits with return code = -9" in log, log[
        -2000:
    ]
    deadline = time.monotonic() + 10
    while f"Killed process {victim} " not in kernel_dmesg() and time.monotonic() < deadline:
        time.sleep(0.2)
    records = [line for line in kernel_dmesg().splitlines() if str(victim) in line]
    (tmp_path / "dmesg.txt").write_text("\n".join(records))
    rc, out, err = diagnose_cli(
        "--format", "json", str(job.dir / "torchrun.log"), str(tmp_path / "dmesg.txt")
    )
    assert rc == 0, err
    doc = json.loads(out)
    k = doc["killer"]
    assert (k["kind"], k["confidence"]) == ("cgroup_oom", "certain"), k
    assert doc["victim"]["pid"] == victim and doc["victim"]["local_rank"] == 1, doc["victim"]
    fates = {r["pid"]: r["fate"] for r in doc["ranks"]}
    assert fates[victim] == "root_cause" and len(doc["ranks"]) == 2, doc["ranks"]


@pytest.mark.root
@requires("slurm")
def test_a_dataloader_worker_killed_by_its_slurm_step_s_limit_is_named_from_srun_s_output(tmp_path):
    """``srun --mem=768M --output=FILE`` (the task's output in a file, as a batch job's
    slurm-N.out): the step's cgroup limit kills the DataLoader worker; the main process ends
    on torch's word for the worker's death (``is killed by signal: Killed.``, ``exited
    unexpectedly``: how it died, not why) and slurmstepd writes the step's oom-kill event
    into the file. From the file and srun's stderr diagnose names the step's limit (likely:
    Slurm's record names no pid); without slurmstepd's line the relayed death names no
    killer and the exception stays possible."""
    env = dict(slurm.cluster(), OMP_NUM_THREADS="1")
    out = tmp_path / "slurm-task.out"
    cmd = [
        "srun", "--nodes=1", "--ntasks=1", "--mem=768M", f"--output={out}", "--job-name=tw-loader-oom",
        sys.executable, str(LOADER_OOM),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    text = out.read_text(errors="replace") + run.stderr
    worker = re.search(r"^worker (\d+)$", text, re.M)
    assert run.returncode != 0 and worker, text[-3000:]
    pid = worker[1]
    told = (f"DataLoader worker (pid {pid}) is killed by signal: Killed.", f"(pid(s) {pid}) exited")
    assert any(t in text for t in told), text[-3000:]
    assert "oom-kill event" in text, text[-3000:]
    log = tmp_path / "job.log"
    log.write_text(text)
    rc, stdout, _ = diagnose_cli("--format", "json", str(log))
    killer = json.loads(stdout)["killer"]
    assert rc == 0 and (killer["kind"], killer["confidence"]) == ("cgroup_oom", "likely"), killer
    assert "DataLoader worker" in killer["summary"] and "Slurm" in killer["summary"], killer
    alone = tmp_path / "no-slurm.log"
    ours = [line for line in text.splitlines() if "slurmstepd" not in line and "srun:" not in line]
    alone.write_text("\n".join(ours))
    rc, stdout, _ = diagnose_cli("--format", "json", str(alone))
    killer = json.loads(stdout)["killer"]
    assert (killer["kind"], killer["confidence"]) == ("python_exception", "possible"), killer


@pytest.mark.root
@requires("slurm")
def test_srun_s_teardown_after_a_task_s_own_failure_is_no_cancel_from_outside(tmp_path):
    """``srun -l --kill-on-bad-exit=1``: rank 1 raises; srun reports ``task 1: Exited with
    exit code 1``, ends the step (slurmstepd's ``*** STEP ... CANCELLED ***``) and reports
    rank 0 ``Terminated``. From srun's output alone: rank 1's exception, rank 0 ended by the
    launcher; the step's cancellation is srun's teardown, not a cancel from outside (it was
    named external_signal, likely)."""
    env = dict(slurm.cluster(), OMP_NUM_THREADS="1")
    cmd = [
        "srun", "-l", "--nodes=1", "--ntasks=2", "--mem=1536M", "--kill-on-bad-exit=1",
        "--job-name=tw-bad-exit", sys.executable, str(TASK_JOB), f"--port={free_port()}",
        "--hold-mb=30", "--workers=0", "--duration=60", "--raise-rank=1", "--raise-after=3",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "task 1: Exited with exit code 1" in text, text[-3000:]
    assert "CANCELLED" in text, text[-3000:]  # the step's end, as slurmstepd writes it
    log = tmp_path / "srun.log"
    log.write_text(text)
    rc, out, _ = diagnose_cli("--format", "json", str(log))
    doc = json.loads(out)
    killer = doc["killer"]
    assert rc == 0 and killer["kind"] == "python_exception", killer
    assert "a bad batch on purpose" in killer["summary"], killer
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert set(rows) == {0, 1} and rows[1]["fate"] == "root_cause", doc["ranks"]
    assert survivor_fate_right(rows[0], text), doc["ranks"]  # srun's "Terminated", or gloo first


def test_a_paste_of_the_agent_s_closing_signals_and_a_rank_s_crash_names_the_crash(tmp_path):
    """A real torchrun job whose rank 1 segfaults (faulthandler prints ``Fatal Python error:
    Segmentation fault`` with no rank prefix); the agent sends its closing SIGTERM to rank 0.
    Pasted without the agent's failure report (its ``failed (exitcode: -11)`` line and the
    ChildFailedError table), every process the paste names is one the agent closed: the worker
    whose end it reacted to is another, and the crash in the lines is that worker's (likely,
    no line says which rank). With the whole log, the failure table names rank 1. Rank 0
    waits in the store (a pipeline's hand-off), so the agent's SIGTERM, not a collective's
    error the crash left it in, ends it."""
    faulthandler = {"PYTHONFAULTHANDLER": "1"}  # as many training scripts and launchers set it
    with TorchrunJob(
        tmp_path,
        "segv-paste",
        env=faulthandler,
        hold_mb=50,
        workers=0,
        segfault_rank=1,
        raise_after=2,
        handoff=1,  # no collective to fail: rank 0 lives until the agent's closing SIGTERM
    ) as job:
        job.ready()
        assert job.proc.wait(120) != 0
    log = (job.dir / "torchrun.log").read_text(errors="replace")
    assert "Fatal Python error: Segmentation fault" in log and "closing signal SIGTERM" in log, log[-3000:]
    rc, out, _ = diagnose_cli("--format", "json", str(job.dir / "torchrun.log"))
    assert rc == 0
    whole = json.loads(out)
    assert whole["killer"]["kind"] == "segfault" and whole["victim"]["rank"] == 1, whole["killer"]
    cut = log.split("failed (exitcode")[0]
    cut = "\n".join(cut.splitlines()[:-1])  # the agent's failure report and all after it left out
    assert "Fatal Python error: Segmentation fault" in cut and "closing signal SIGTERM" in cut
    doc = _pasted(tmp_path / "paste.txt", cut)
    assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("segfault", "likely"), doc["killer"]
    (root,) = [r for r in doc["ranks"] if r["fate"] == "root_cause"]
    assert root["rank"] is None and root["pid"] is None, doc["ranks"]  # no line names it
    closed = [r for r in doc["ranks"] if r["pid"] is not None]
    assert closed and all(r["fate"] == "terminated_by_agent" for r in closed), doc["ranks"]


def test_srun_s_teardown_of_a_task_the_paste_does_not_report_is_no_cancel_from_outside(tmp_path):
    """``srun --kill-on-bad-exit=1`` without ``-l``: rank 1 segfaults (faulthandler writes
    ``Fatal Python error: Segmentation fault``, naming no task); srun ends the step
    (slurmstepd's ``*** STEP ... CANCELLED ***``, no reason) and reports rank 0 killed. Pasted
    without srun's line for rank 1, every task the paste reports was killed by the step's
    cancel: that cancel is srun's teardown after the crash in the unnamed lines, not scancel
    (it was external_signal, likely). With srun's whole output, rank 1's segfault. Rank 0
    waits in the store (a pipeline's hand-off), so srun's cancel, not a collective's error
    the crash left it in, ends it."""
    env = dict(slurm.cluster(), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [
        "srun", "--nodes=1", "--ntasks=2", "--mem=1536M", "--kill-on-bad-exit=1",
        "--job-name=tw-unnamed-crash", sys.executable, str(TASK_JOB), f"--port={free_port()}",
        "--hold-mb=30", "--workers=0", "--duration=60", "--segfault-rank=1", "--raise-after=3",
        "--handoff=1",  # rank 0 waits in the store, alive, for srun's cancel (no collective to fail)
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    text = run.stdout + run.stderr
    crashed = re.compile(r"srun: error: \S+: task 1: Segmentation fault[^\n]*\n")
    assert run.returncode != 0 and crashed.search(text), text[-3000:]
    assert "CANCELLED" in text and "Fatal Python error: Segmentation fault" in text, text[-3000:]
    whole = tmp_path / "srun.log"
    whole.write_text(text)
    rc, out, _ = diagnose_cli("--format", "json", str(whole))
    doc = json.loads(out)
    assert rc == 0 and doc["killer"]["kind"] == "segfault" and doc["victim"]["rank"] == 1, doc["killer"]
    doc = _pasted(tmp_path / "paste.log", crashed.sub("", text))
    assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("segfault", "likely"), doc["killer"]
    (root,) = [r for r in doc["ranks"] if r["fate"] == "root_cause"]
    assert root["rank"] is None, doc["ranks"]  # no line the paste kept names it
    assert {r["rank"]: r["fate"] for r in doc["ranks"] if r["rank"] is not None} == {0: "terminated_by_agent"}


@requires("openmpi")
def test_open_mpi_s_tagged_output_names_the_rank_that_raised(tmp_path):
    """``mpirun --tag-output``: Open MPI writes ``[jobid,rank]<stderr>:`` before every line a
    rank prints, as Horovod's users paste it. Rank 1 raises; the others are ended by mpirun.
    diagnose reads the tags as the ranks and names rank 1's exception (before the tags were
    read, none of the traceback was any rank's: unknown)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        "mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--tag-output",
        "-np", "2", sys.executable, str(TASK_JOB), f"--port={free_port()}", "--hold-mb=30", "--workers=0",
        "--duration=60", "--raise-rank=1", "--raise-after=3",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and re.search(r"^\[\d+,1\]<stderr>:", text, re.M), text[-3000:]
    doc = _pasted(tmp_path / "mpirun.log", text)
    assert (doc["killer"]["kind"], doc["victim"]["rank"]) == ("python_exception", 1), doc["killer"]


# faulthandler's report as its C code writes it (faulthandler_fatal_error: "Fatal Python error: ",
# then the signal's name, then the line's end, each its own write), with the pipe drained between
# the first two: orte's iof then reads them as two chunks whatever the machine's load. Then the
# signal itself, as faulthandler re-raises it.
_FAULTHANDLER_IN_WRITES = """
import fcntl, os, signal, struct, termios, time
def drained():
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if struct.unpack("i", fcntl.ioctl(2, termios.FIONREAD, b"\\0" * 4))[0] == 0:
            return
        time.sleep(0.01)
os.write(2, b"Fatal Python error: ")
drained()
os.write(2, b"Segmentation fault")
os.write(2, b"\\n\\n")
drained()
signal.signal(signal.SIGSEGV, signal.SIG_DFL)
os.kill(os.getpid(), signal.SIGSEGV)
"""


@requires("openmpi")
def test_open_mpi_s_tags_between_one_line_s_writes_do_not_hide_a_segfault(tmp_path):
    """orte's iof tags each chunk it reads from a rank's pipe, not each line: faulthandler
    writes ``Fatal Python error: `` and ``Segmentation fault`` apart, and the line comes out
    ``Fatal Python error: [1,0]<stderr>:Segmentation fault``. A paste of the rank's lines
    alone (mpirun's own notice cut off, as Horovod's users paste it) is that segfault, not
    the interpreter's abort() on a fatal error that the tagged line read as (likely, wrong)."""
    cmd = ["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--tag-output",
           "-np", "1", sys.executable, "-c", _FAULTHANDLER_IN_WRITES]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO)
    text = run.stdout + run.stderr
    assert "exited on signal 11" in text, text[-3000:]
    mine = "".join(line for line in text.splitlines(keepends=True) if re.match(r"\[\d+,0\]<stderr>:", line))
    assert re.search(r"Fatal Python error: \[\d+,0\]<stderr>:Segmentation fault", mine), mine
    doc = _pasted(tmp_path / "rank0.log", mine)
    assert doc["killer"]["kind"] == "segfault", doc["killer"]
    said = [e["detail"] for e in doc["killer"]["evidence"]]
    assert any(t.startswith("Fatal Python error: Segmentation fault") for t in said), said


@pytest.mark.root
@requires("openmpi")
def test_mpirun_s_own_time_limit_is_a_signal_from_outside(tmp_path):
    """``mpirun --timeout N``: Open MPI's own limit on the job's run time. The ranks keep
    running until it is reached; mpirun then says so and kills every one of them. The ranks
    did nothing wrong: the launcher's limit ended them (external_signal, likely: a hung job
    runs into the limit too, which its words cannot tell)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        "mpirun.openmpi", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--timeout", "4",
        "-np", "2", sys.executable, str(TASK_JOB), f"--port={free_port()}", "--hold-mb=30", "--workers=0",
        "--duration=120",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    text = run.stdout + run.stderr
    assert "time limit for job execution has been reached" in text, text[-3000:]
    doc = _pasted(tmp_path / "mpirun.log", text)
    assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("external_signal", "likely"), doc[
        "killer"
    ]


def test_a_store_wait_that_saw_no_reply_is_a_store_timeout_even_cut_short(tmp_path):
    """A real TCPStore client waits for a key no one sets: torch's socket layer warns that
    waitForInput timed out, then the store raises ``wait timeout after Nms``. The whole
    output is that store timeout; a paste cut before the raise (the traceback's last line
    lost, as a progress bar's or a page's cut leaves it) still names a store wait that saw
    no reply, at possible (the raise is not in its words); before, nothing was read."""
    script = tmp_path / "store.py"
    script.write_text(
        "import datetime, torch.distributed as dist\n"
        "t = datetime.timedelta(seconds=2)\n"
        "server = dist.TCPStore('127.0.0.1', 0, 1, True, timeout=t)\n"
        "client = dist.TCPStore('127.0.0.1', server.port, 1, False, timeout=t)\n"
        "client.get('a-key-no-rank-sets')\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "waitForInput: socket" in text, text[-3000:]
    doc = _pasted(tmp_path / "whole.log", text)
    assert doc["killer"]["kind"] == "collective_timeout", doc["killer"]
    cut = "".join(line for line in text.splitlines(keepends=True) if "wait timeout after" not in line)
    killer = _pasted(tmp_path / "cut.log", cut)["killer"]
    assert (killer["kind"], killer["confidence"]) == ("collective_timeout", "possible"), killer


def test_a_rendezvous_that_never_filled_is_a_store_barrier_that_timed_out(tmp_path):
    """torchrun asked for two nodes and only one came: the agents' rendezvous, a barrier kept
    in the c10d store, waits out its join timeout and the agent raises RendezvousTimeoutError.
    That is a store timeout (collective_timeout, likely), not an exception of the job's own;
    the paste holds nothing else, and diagnose says what it read it as."""
    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(60)\n")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-conf", "join_timeout=5",
        str(script),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "RendezvousTimeoutError" in text, text[-3000:]
    paste = tmp_path / "torchrun.log"
    doc = _pasted(paste, text)
    assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("collective_timeout", "likely"), doc[
        "killer"
    ]
    rc, out, _ = diagnose_cli(str(paste))
    assert rc == 0 and "nothing recognised" not in out, out


def test_submitit_s_time_limit_handler_is_a_signal_from_outside(tmp_path):
    """submitit (the Slurm executor fairseq, detectron2 and DINO launch through), run for real
    by its local executor with a limit of seconds: its handler catches the warning signal,
    will not requeue a job that cannot checkpoint and raises UncompletedJobError. The job's
    own logs say a scheduler ended it: external_signal, not the exception it left."""
    job = REPO / "tests" / "workloads" / "submitit_job.py"
    run = subprocess.run(
        [sys.executable, str(job), str(tmp_path / "jobs")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    logs = [line for line in run.stdout.splitlines() if line.endswith((".out", ".err"))]
    text = "".join(Path(path).read_text() for path in logs)
    assert "Caught signal SIGUSR2" in text and "UncompletedJobError" in text, text[-3000:]
    rc, out, _ = diagnose_cli("--format", "json", *logs)
    doc = json.loads(out)
    assert rc == 0 and (doc["killer"]["kind"], doc["killer"]["confidence"]) == (
        "external_signal",
        "likely",
    ), doc["killer"]


def test_a_launcher_s_report_of_its_shell_s_status_names_the_signal(tmp_path):
    """A launcher runs its command through a shell that does not exec it (``cmd; exit $?``,
    as a wrapper script does); the command segfaults; the shell exits 128+11 and the
    launcher raises CalledProcessError(139). From the launcher's output alone (the shell's
    own "Segmentation fault" line left out, as a launcher that keeps its shell's stderr does),
    diagnose names the signal, not an uncaught Python exception."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import subprocess, sys\n"
        "subprocess.check_call(f\"{sys.executable} -c 'import ctypes; ctypes.string_at(0)'; exit $?\", "
        "shell=True, stderr=subprocess.DEVNULL)\n"
    )
    run = subprocess.run([sys.executable, str(launcher)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "returned non-zero exit status 139" in run.stderr, run.stderr
    log = tmp_path / "launcher.log"
    log.write_text(run.stdout + run.stderr)
    rc, out, err = diagnose_cli("--format", "json", str(log))
    assert rc == 0, err
    killer = json.loads(out)["killer"]
    assert (killer["kind"], killer["confidence"]) == ("segfault", "likely"), killer
    assert any("exit status 139" in e["detail"] for e in killer["evidence"]), killer["evidence"]
