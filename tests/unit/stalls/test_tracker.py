"""The stall rules on synthetic snapshots with a fake clock (the real hangs are in
tests/e2e/test_run.py and tests/e2e/test_stall.py, and the GPU machine's in
tests/unit/stalls/test_tracker_device.py): a rank is idle under 5 % of a core and no GPU use over a
window of seconds; a rank whose GPU is busy while a peer's GPU ran nothing is waiting.
The snapshot's flight-recorder request goes through a real FIFO to a real process that
plays the NCCL monitor's part."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

from sidecar.model import JobSample, ProcKey, RankSample, Snapshot
from sidecar.stalls.stacks import in_collective
from sidecar.stalls.tracker import StallTracker
from tests.support.e2e import wait_for


def _rank(pid: int, cpu: float, sm: float | None = None, **kw) -> RankSample:
    return RankSample(
        "j",
        pid,
        str(pid),
        pid,
        0,
        ProcKey(100 + pid, 1),
        1,
        None,
        cpu,
        1,
        1,
        1,
        None,
        gpu_sm_percent=sm,
        **kw,
    )


def _snap(*ranks: RankSample) -> Snapshot:
    job = JobSample("j", ProcKey(99, 1), None, len(ranks), 0, 0, None, 0.0, tuple(ranks))
    return Snapshot(0.0, 0.0, (job,), None, (), (), {}, 0, 0, 0.0, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_idle_ranks_are_stalled_and_the_working_one_is_suspected():
    clock = Clock()
    t = StallTracker(6.0, py_spy=False, clock=clock)
    assert t.window == 3.0
    cpu = {0: 10.0, 1: 10.0}
    seen = []
    for step in range(60):  # 0.5 s rounds
        clock.now = step * 0.5
        if step < 10:  # both work for 5 s
            cpu = {r: c + 0.4 for r, c in cpu.items()}
        elif step < 40:  # rank 1 works (a loop that never reaches the collective), rank 0 waits
            cpu = {0: cpu[0] + 0.005, 1: cpu[1] + 0.4}
        else:  # both idle, a 10 ms tick now and then (background threads)
            cpu = {r: c + (0.01 if step % 4 == 0 else 0.0) for r, c in cpu.items()}
        job = t.update(_snap(_rank(0, cpu[0]), _rank(1, cpu[1]))).jobs[0]
        seen.append(job)
    assert all(j.stalled_seconds == 0.0 for j in seen[:10])
    waiting = seen[39]
    r0, r1 = waiting.ranks
    assert r0.progress.reason == "idle" and not r0.progress.cpu_busy and r0.progress.gpu_busy is None
    assert r1.progress.reason is None and r1.progress.cpu_busy and r1.progress.stalled_seconds == 0.0
    # judged over the 3 s window: counted from the last window in which rank 0 worked
    assert 12.0 <= waiting.stalled_seconds <= 15.0
    assert waiting.suspected_missing == ("1",)
    both = seen[-1]
    assert {r.progress.reason for r in both.ranks} == {"idle"} and both.suspected_missing == ()
    assert both.stalled_seconds > seen[-2].stalled_seconds
    # work again: back to 0; a new rank (a restart) is progress by definition
    clock.now += 0.5
    job = t.update(_snap(_rank(0, cpu[0] + 1.0), _rank(1, cpu[1] + 1.0))).jobs[0]
    assert job.stalled_seconds == 0.0 and job.suspected_missing == ()
    clock.now += 10
    job = t.update(_snap(_rank(0, cpu[0] + 2.0), _rank(1, cpu[1] + 2.0), _rank(2, 0.0))).jobs[0]
    assert job.ranks[2].progress.reason is None


def _run(t: StallTracker, clock: Clock, seconds: float, ranks) -> JobSample:
    """Rounds of 0.5 s; ``ranks``: pid -> (CPU cores used, GPU SM % or None)."""
    cpu = dict.fromkeys(ranks, 0.0)
    job = None
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        cpu = {p: c + 0.5 * ranks[p][0] for p, c in cpu.items()}
        job = t.update(_snap(*(_rank(p, cpu[p], ranks[p][1]) for p in ranks))).jobs[0]
    assert job is not None
    return job


def test_a_busy_gpu_waiting_for_a_silent_peer_is_stalled():
    """An NCCL rank in a collective spins its GPU at 100 % and may spin a core too; its
    peer never launched the collective: its GPU runs nothing."""
    clock = Clock()
    t = StallTracker(10.0, py_spy=False, clock=clock)
    job = _run(t, clock, 20, {0: (1.0, 100.0), 1: (0.0, 0.0)})
    r0, r1 = job.ranks
    assert r0.progress.reason == "waiting" and r0.progress.gpu_busy and r0.progress.cpu_busy
    assert r1.progress.reason == "idle" and r1.progress.gpu_busy is False
    assert job.suspected_missing == ("1",) and job.stalled_seconds >= 15
    # the missing rank busy on its CPU (a Python loop): still the one the others wait for
    t = StallTracker(10.0, py_spy=False, clock=clock)
    job = _run(t, clock, 20, {0: (0.0, 100.0), 1: (1.0, 0.0), 2: (0.1, 97.0)})
    assert [r.progress.reason for r in job.ranks] == ["waiting", None, "waiting"]
    assert job.suspected_missing == ("1",)


def test_working_gpus_are_not_stalled():
    """Training: busy GPUs whose activity varies, a rank whose GPU idles part of the window
    (its data loader was late), a GPU whose activity NVML does not report."""
    clock = Clock()
    t = StallTracker(10.0, py_spy=False, clock=clock)
    cpu = {0: 0.0, 1: 0.0, 2: 0.0}
    for step in range(80):
        clock.now += 0.5
        cpu = {p: c + 0.3 for p, c in cpu.items()}
        sm1 = 0.0 if step % 10 < 7 else 80.0  # idle 70 % of the time, never a whole window
        snap = _snap(_rank(0, cpu[0], 60.0 + step % 30), _rank(1, cpu[1], sm1), _rank(2, cpu[2], None))
        job = t.update(snap).jobs[0]
        assert job.stalled_seconds == 0.0, step
        assert [r.progress.reason for r in job.ranks] == [None, None, None]
    assert job.ranks[2].progress.gpu_busy is None
    # without GPU data for a peer, a busy GPU is never judged waiting
    t = StallTracker(10.0, py_spy=False, clock=clock)
    job = _run(t, clock, 20, {0: (0.0, 100.0), 1: (0.0, None)})
    assert job.ranks[0].progress.reason is None and job.ranks[1].progress.reason == "idle"


def test_the_snapshot_comes_once_per_stall_and_ends_with_it():
    clock = Clock()
    t = StallTracker(4.0, py_spy=False, clock=clock, wall=lambda: 1_700_000_000.0 + clock.now)
    job = _run(t, clock, 12, {0: (0.0, None), 1: (0.0, None)})
    assert job.stalled_seconds >= 4
    snap = wait_for(lambda: t.stall("j"), 10, "the snapshot", 0.05)
    assert snap.suspected_missing == () and snap.flight_recorder is None
    assert [r.reason for r in snap.ranks] == ["idle", "idle"]
    assert all(r.stack is None and r.stack_error == "turned off (--no-py-spy)" for r in snap.ranks)
    _run(t, clock, 6, {0: (1.0, None), 1: (1.0, None)})
    ended = t.stall("j")  # progress again; kept a while (a rank's exit at a timeout uses CPU)
    assert ended is not None and 1_700_000_012.0 < ended.ended_at <= 1_700_000_000.0 + clock.now
    _run(t, clock, 31, {0: (1.0, None), 1: (1.0, None)})
    assert t.stall("j") is None  # a later death was not preceded by it


SPY_DUMP = textwrap.dedent(
    """\
    Process 4242: /usr/bin/python3 -u rank.py
    Python v3.11.2 (/usr/bin/python3.11)

    Thread 4242 (idle): "MainThread"
        all_reduce (torch/distributed/distributed_c10d.py:2810)
        wrapper (torch/distributed/c10d_logger.py:81)
        main (rank.py:21)
        <module> (rank.py:30)
    """
)


def test_a_stack_inside_a_collective():
    assert in_collective(SPY_DUMP)
    assert not in_collective(
        SPY_DUMP.replace("torch/distributed/distributed_c10d.py", "train.py").replace(
            "torch/distributed/c10d_logger.py", "train.py"
        )
    )


MONITOR = textwrap.dedent(
    """\
    # Plays ProcessGroupNCCL's monitor: makes <pipe prefix><rank>.pipe, and each time a byte
    # comes through it writes a flight-recorder dump (a pickle of plain data) to
    # <dump prefix><rank>, as torch does on demand. Ready once the FIFO is open for reading
    # (a writer that comes before is refused: nobody reads it), however slow the machine.
    import os, pickle, sys, time
    pipe_prefix, dump_prefix, rank, enq, done = sys.argv[1:6]
    path = f"{pipe_prefix}{rank}.pipe"
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    print("ready", flush=True)
    while True:
        try:
            if os.read(fd, 1):
                break
        except BlockingIOError:
            pass
        time.sleep(0.01)
    doc = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg"}},
           "pg_status": {"0": {"last_enqueued_collective": int(enq), "last_started_collective": -1,
                               "last_completed_collective": int(done)}},
           "entries": [{"collective_seq_id": int(enq), "profiling_name": "nccl:all_reduce",
                        "state": "scheduled", "process_group": ["0", "default_pg"], "timeout_ms": 600000}]}
    with open(f"{dump_prefix}{rank}.tmp", "wb") as f:
        pickle.dump(doc, f)
    os.rename(f"{dump_prefix}{rank}.tmp", f"{dump_prefix}{rank}")
    sys.stdin.read()
    """
)


def test_the_snapshot_asks_the_flight_recorder_through_the_jobs_fifo(tmp_path):
    """Two "ranks" with TORCH_NCCL_DEBUG_INFO_PIPE_FILE set: a byte into each FIFO, each
    dumps, and the snapshot names the rank that never entered the collective."""
    pipe, dump = str(tmp_path / "pipe_"), str(tmp_path / "dump_")
    procs = []
    try:
        for rank, enq, done in ((0, 7, 6), (1, 6, 6)):
            p = subprocess.Popen(
                [sys.executable, "-c", MONITOR, pipe, dump, str(rank), str(enq), str(done)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        # an older dump of rank 1 is already there (it entered #7 then): not the one asked for
        old = {
            "pg_status": {"0": {"last_enqueued_collective": 7, "last_completed_collective": 7}},
            "entries": [],
        }
        with open(f"{dump}1", "wb") as f:
            pickle.dump(old, f)
        os.utime(f"{dump}1", (1_000_000_000, 1_000_000_000))
        clock = Clock()
        t = StallTracker(4.0, py_spy=False, clock=clock)
        ranks = [
            RankSample(
                "j",
                r,
                str(r),
                r,
                0,
                ProcKey(p.pid, 1),
                1,
                None,
                0.0,
                1,
                1,
                1,
                None,
                flight_recorder=(2000, dump),
                flight_pipe=pipe,
                uid=os.getuid(),
                gpu_sm_percent=sm,
            )
            for r, p, sm in ((0, procs[0], 100.0), (1, procs[1], 0.0))
        ]
        for _ in range(20):
            clock.now += 0.5
            job = t.update(_snap(*ranks)).jobs[0]
        assert job.stalled_seconds >= 4 and job.suspected_missing == ("1",)
        snap = wait_for(lambda: t.stall("j"), 30, "the snapshot with both dumps", 0.1)
        fr = snap.flight_recorder
        assert f"dump requested from rank 0 through '{pipe}0.pipe', rank 1 through '{pipe}1.pipe'" in fr, fr
        assert "rank 1, default_pg: last enqueued #6, last completed #6 (never entered #7)" in fr, fr
        assert snap.suspected_missing == ("1",) and snap.suspected_by == "flight_recorder"
        with open(f"{dump}0", "rb") as f:
            assert pickle.load(f)["pg_status"]["0"]["last_enqueued_collective"] == 7
    finally:
        for p in procs:
            p.kill()
            p.communicate()


PROGRESS_MONITOR = textwrap.dedent(
    """\
    # The NCCL monitor's part again, answering every byte with a dump from a script:
    # argv[4:] are "enqueued,completed" pairs, one per request, the last one repeated.
    import os, pickle, sys, time
    pipe_prefix, dump_prefix, rank = sys.argv[1:4]
    script = [tuple(int(x) for x in pair.split(",")) for pair in sys.argv[4:]]
    path = f"{pipe_prefix}{rank}.pipe"
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # kept open, polled, as torch's DumpPipe does
    print("ready", flush=True)  # open first: a writer before the open is refused
    n = 0
    while True:
        try:
            got = os.read(fd, 1)
        except BlockingIOError:
            got = b""
        if not got:
            time.sleep(0.01)
            continue
        enq, done = script[min(n, len(script) - 1)]
        n += 1
        doc = {"pg_config": {"0": {"name": "0", "desc": "default_pg"}},
               "pg_status": {"0": {"last_enqueued_collective": enq, "last_started_collective": -1,
                                   "last_completed_collective": done}},
               "entries": [{"collective_seq_id": enq, "profiling_name": "nccl:all_reduce",
                            "state": "scheduled", "process_group": ["0", "default_pg"],
                            "timeout_ms": 600000}]}
        with open(f"{dump_prefix}{rank}.tmp", "wb") as f:
            pickle.dump(doc, f)
        os.rename(f"{dump_prefix}{rank}.tmp", f"{dump_prefix}{rank}")
    """
)


def test_busy_gpus_whose_collectives_stop_completing_are_stalled(tmp_path):
    """Every rank's GPU pinned busy (ranks spinning for a rank on another node look so, and
    so does hard work): the flight recorder, asked through the job's FIFO every few seconds,
    tells them apart. While collectives complete between dumps the job works; once none
    completes, the ranks with one pending are stalled ("collective") from the last dump that
    still moved, and the rank that never entered the newest collective is the suspect."""
    pipe, dump = str(tmp_path / "pipe_"), str(tmp_path / "dump_")
    scripts = {0: ["10,9", "12,11", "13,12"], 1: ["10,9", "12,11", "12,12"]}
    procs = []
    try:
        for rank, script in scripts.items():
            p = subprocess.Popen(
                [sys.executable, "-c", PROGRESS_MONITOR, pipe, dump, str(rank), *script],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        clock = Clock()
        t = StallTracker(6.0, py_spy=False, clock=clock)
        ranks = [
            RankSample(
                "j", r, str(r), r, 0, ProcKey(p.pid, 1), 1, None, 0.0, 1, 1, 1, None,
                flight_recorder=(2000, dump), flight_pipe=pipe, uid=os.getuid(), gpu_sm_percent=100.0,
            )
            for r, p in enumerate(procs)
        ]  # fmt: skip
        jobs = []
        for step in range(60):
            clock.now = step * 0.5
            jobs.append((clock.now, t.update(_snap(*ranks)).jobs[0]))
            # let a probe the round started answer before time moves on (its dumps are real)
            wait_for(lambda: not t._jobs["j"].probing, 30, "the flight-recorder probe", 0.02)
        progressing = [job for at, job in jobs if at < 13.0]
        assert all(job.stalled_seconds == 0.0 for job in progressing)
        at, last = jobs[-1]
        r0, r1 = last.ranks
        assert r0.progress.reason == "collective" and r0.progress.gpu_busy, r0.progress
        assert r1.progress.reason is None  # it completed its collectives: busy elsewhere
        assert last.suspected_missing == ("1",)
        # stalled since the last dump that still moved (the probe at 13 s), not since the hang
        assert last.stalled_seconds == at - 13.0
        assert any(job.stalled_seconds >= 6.0 for _, job in jobs)
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_the_stall_snapshot_shows_its_times_as_each_reader_dates_them():
    """/ranks shows a stall's times in seconds, the postmortem in ISO 8601: one snapshot,
    its fields in the document's order, an end added without touching the first."""
    from sidecar.model.stall import StalledRank, StallSnapshot
    from sidecar.postmortem import iso

    rank = StalledRank(1, "1", 42, 61.0, "idle", False, False, None, None, None, "no py-spy", None)
    snap = StallSnapshot(1_700_000_000.0, 61.0, (rank,), ("1",), "activity", None)
    done = snap.ended(1_700_000_030.0)
    assert snap.ended_at is None and done.ended_at == 1_700_000_030.0
    shown = done.view()
    assert list(shown) == [
        "detected_at", "stalled_seconds", "ranks", "suspected_missing", "suspected_by", "flight_recorder",
        "ended_at",
    ]  # fmt: skip
    assert shown["detected_at"] == 1_700_000_000.0 and shown["suspected_missing"] == ["1"]
    assert shown["ranks"] == [
        {
            "rank": 1, "label": "1", "pid": 42, "stalled_seconds": 61.0, "reason": "idle", "cpu_busy": False,
            "gpu_busy": False, "gpu_sm_percent": None, "gpu_memory_percent": None, "stack": None,
            "stack_error": "no py-spy", "in_collective": None,
        }
    ]  # fmt: skip
    dated = done.view(iso)
    assert dated["detected_at"] == iso(1_700_000_000.0) and dated["ended_at"] == iso(1_700_000_030.0)
    assert snap.view(iso)["ended_at"] is None
