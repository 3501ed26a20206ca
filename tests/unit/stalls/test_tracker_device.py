"""The GPU machine's stall run (benchmarks/gpu_stall.py on the lent H200, kept as
tests/fixtures/device-h200/gpu-stall.json): two NCCL ranks on one GPU train (large matmuls,
then a small MLP), then rank 0 enters an all_reduce rank 1 never joins.

The raw signal the run kept (NVML's per-process utilisation and each rank's CPU time,
read every 0.5 s beside the daemon) is replayed through today's StallTracker: the hang is
flagged with rank 0 waiting while its GPU is busy, the training never is. What the daemon
itself flagged and snapshotted in that run (its /ranks, its flight-recorder request, the
postmortem after rank 1 was SIGKILLed) is checked as the run's record."""

from __future__ import annotations

import json

import pytest

from sidecar.model import JobSample, ProcKey, RankSample, Snapshot
from sidecar.postmortem.text import render_text
from sidecar.stalls.tracker import StallTracker
from tests.support.paths import DEVICE_H200

RUN = json.loads((DEVICE_H200 / "gpu-stall.json").read_text())
STALL_AFTER = RUN["settings"]["stall_after"]
START = {name: at for name, at, _ in RUN["phases"]["0"]}
PIDS = {int(rank): entries[0][2] for rank, entries in RUN["phases"].items()}


def _replay(run: dict | None = None) -> list[tuple[float, JobSample]]:
    """Each kept NVML/CPU sample as a snapshot of the two ranks, through one tracker."""
    run = run or RUN
    pids = {int(rank): entries[0][2] for rank, entries in run["phases"].items()}
    clock = [0.0]
    tracker = StallTracker(STALL_AFTER, py_spy=False, clock=lambda: clock[0], wall=lambda: clock[0])
    out = []
    for s in run["nvml_samples"]:
        cpu = s.get("cpu", {})
        if "util" not in s or any(cpu.get(str(pid)) is None for pid in pids.values()):
            continue  # before the ranks announced themselves, or after one died
        clock[0] = s["at"]
        ranks = []
        for rank, pid in sorted(pids.items()):
            mine = s["util"].get(str(pid), [])
            sm = sum(v[0] for v in mine) / len(mine) if mine else 0.0
            ranks.append(
                RankSample(
                    "j", rank, str(rank), rank, 0, ProcKey(pid, 1), 1, None, cpu[str(pid)], 1, 1, 1, None,
                    gpu_sm_percent=sm,
                )
            )  # fmt: skip
        job = JobSample("j", ProcKey(1, 1), None, 2, 0, 0, None, 0.0, tuple(ranks))
        out.append(
            (s["at"], tracker.update(Snapshot(0.0, 0.0, (job,), None, (), (), {}, 0, 0, 0.0, 0)).jobs[0])
        )
    return out


def test_the_kept_signal_is_a_spinning_gpu_beside_a_silent_one():
    hang = [
        s for s in RUN["nvml_samples"] if START["hang"] + 2 <= s["at"] <= RUN["killed"]["at"] and "util" in s
    ]
    assert len(hang) >= 20
    for s in hang:
        assert [v[0] for v in s["util"][str(PIDS[0])]] and min(v[0] for v in s["util"][str(PIDS[0])]) >= 99
        assert str(PIDS[1]) not in s["util"] or max(v[0] for v in s["util"][str(PIDS[1])]) == 0


def test_replayed_the_training_is_never_stalled_and_the_hang_is():
    replay = _replay()
    training = [job for at, job in replay if START["big"] <= at < START["hang"]]
    assert len(training) >= 100  # 60 s of work at 2 samples a second
    assert max(job.stalled_seconds for job in training) < STALL_AFTER
    # a real wait, short: rank 1 came to the small phase's first collective 1.4 s after rank
    # 0 (it built its model), whose GPU spun meanwhile; nowhere else did a rank wait
    waits = [at for at, job in replay if START["big"] <= at < START["hang"] and job.stalled_seconds > 0]
    assert all(abs(at - START["small"]) < 5 for at in waits), waits
    hang = [(at, job) for at, job in replay if at >= START["hang"]]
    flagged = next(((at, job) for at, job in hang if job.stalled_seconds >= STALL_AFTER), None)
    assert flagged is not None
    at, job = flagged
    # the threshold, plus the window over which a rank is judged
    assert at - START["hang"] <= STALL_AFTER + 5 + 2
    r0, r1 = job.ranks
    assert r0.progress is not None and r0.progress.reason == "waiting" and r0.progress.gpu_busy
    assert r0.progress.cpu_busy  # it spins in torch.cuda.synchronize(): CPU alone would miss it
    assert r1.progress is not None and r1.progress.reason == "idle"
    assert job.suspected_missing == ("1",)


@pytest.mark.parametrize("where", ["ranks", "postmortem"])
def test_the_runs_daemon_snapshotted_the_stall(where):
    """The run's record: the stall's snapshot asked both ranks' flight recorders through
    their FIFOs and read the answer (rank 1 never entered the collective); py-spy's stacks
    were taken without pausing the ranks; the postmortem after rank 1's SIGKILL kept it."""
    if where == "ranks":
        stall = RUN["ranks_at_stall"]["jobs"][0]["stall"]
    else:
        pm = RUN["postmortem"]
        assert pm["killer"]["kind"] == "external_signal" and pm["victim"]["rank"] == 1
        stall = pm["stall"]
    assert stall["suspected_missing"] == ["1"] and stall["suspected_by"] == "flight_recorder"
    assert "(never entered #7006)" in stall["flight_recorder"]
    ranks = {r["label"]: r for r in stall["ranks"]}
    assert ranks["0"]["reason"] == "waiting" and ranks["0"]["gpu_sm_percent"] == 100.0
    assert "synchronize (torch/cuda/__init__.py" in ranks["0"]["stack"]
    assert "main (gpu_hang.py" in ranks["1"]["stack"] and ranks["1"]["reason"] == "idle"


def test_the_text_view_tells_the_stall():
    text = render_text(RUN["postmortem"])
    assert (
        "stalled before the death: flagged at T-12 s, after 10 s without progress; waiting for rank 1" in text
    )
    assert "(told by the flight recorder)" in text and "(never entered #7006)" in text
    assert "  rank 0: waiting, CPU busy, GPU 100 % busy\n      synchronize (torch/cuda/__init__.py" in text
    assert "  rank 1: idle, CPU idle, GPU 0 % busy\n      main (gpu_hang.py:76)" in text


def test_the_html_view_shows_the_stall_and_its_stacks():
    from sidecar.postmortem.html import render_html

    html = render_html(RUN["postmortem"])
    assert (
        "<h2>Stalled before the death</h2>" in html and "waiting for rank 1 (told by flight_recorder)" in html
    )
    assert "<pre>Process" in html and "synchronize (torch/cuda/__init__.py" in html


CROSSED = json.loads((DEVICE_H200 / "gpu-stall-crossed.json").read_text())


def test_crossed_collectives_keep_every_gpu_busy_and_only_the_flight_recorder_tells():
    """The crossed run: each rank in an all_reduce of another process group, both kernels
    spinning (two processes time-share one GPU: 50 % each). Activity alone cannot tell this
    from work, and the replay through today's tracker (no flight recorder in a replay) does
    not; the run's daemon, asking the flight recorder every 5 s, flagged both ranks
    'collective' within the threshold plus a probe or two, and never during the 60 s of
    training, when its probes ran too."""
    start = {name: at for name, at, _ in CROSSED["phases"]["0"]}
    hang = [
        s
        for s in CROSSED["nvml_samples"]
        if start["hang"] + 3 <= s["at"] <= CROSSED["killed"]["at"] and "util" in s
    ]
    pids = [entries[0][2] for entries in CROSSED["phases"].values()]
    assert len(hang) >= 10
    for pid in pids:  # both GPUs busy through the hang
        mean = sum(sum(v[0] for v in s["util"].get(str(pid), [(0, 0)])) for s in hang) / len(hang)
        assert mean >= 40, (pid, mean)
    judged = CROSSED["judged"]
    assert not any(j["stalled"] for j in judged if j["at"] < start["hang"])
    flagged = next(j for j in judged if j["at"] >= start["hang"] and j["stalled"])
    assert flagged["at"] - start["hang"] <= STALL_AFTER + 2 * 5 + 2
    assert {label: r[0] for label, r in flagged["ranks"].items()} == {"0": "collective", "1": "collective"}
    replayed = [job for at, job in _replay(CROSSED) if at >= start["hang"]]
    assert replayed and max(job.stalled_seconds for job in replayed) == 0.0  # activity alone: "working"
    stall = CROSSED["postmortem"]["stall"]
    assert stall["suspected_by"] == "flight_recorder" and "waiting in #" in stall["flight_recorder"]
    assert CROSSED["postmortem"]["killer"]["sender"]["comm"] == "python3"  # named from /proc, not <...>
