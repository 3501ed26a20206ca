"""The GPU machines' runs replayed through today's trackers: does a rank's GPU spin only when
it polls for a peer, and is a survivor left spinning by a death stranded?

* tests/fixtures/device-h200/gpu-stall*.json (benchmarks/gpu_stall.py, H200): two NCCL
  ranks on one GPU train (large matmuls, then a small MLP), then hang. NVML's per-process
  utilisation (SM and memory) and each rank's CPU time, read raw every 0.5 s, replayed
  through the StallTracker: no training round is ever spinning; rank 0 alone in its
  all_reduce is; two ranks spinning on one shared GPU are not (each gets half of it: the
  limit of the signal where ranks share a GPU, which real jobs do not).
* tests/fixtures/device-h100/gpu-stranded.json (benchmarks/gpu_stranded.py, H100): each rank
  under its own torchrun agent; rank 1 SIGKILLed itself while rank 0 entered an all_reduce
  with it (``killed``), or while rank 0 entered one with rank 2, which works on
  (``killed-other``). The daemon's own per-round view of each rank (its CPU judged busy,
  NVML's SM and memory percent) replayed through the stall and stranding trackers, the
  death where the run saw rank 1 gone: rank 0 stranded 10-30 s after the death and not
  before; rank 2, working, never. The daemon in that run said the same (kept as the run's
  record).
"""

from __future__ import annotations

import json

import pytest

from sidecar.model import JobSample, ProcKey, RankSample, Snapshot
from sidecar.stalls.stranded import StrandTracker
from sidecar.stalls.tracker import StallTracker
from tests.support.paths import DEVICE_H100, DEVICE_H200

STRANDED = json.loads((DEVICE_H100 / "gpu-stranded.json").read_text())


def _rank(job: str, label: str, pid: int, cpu: float, sm: float | None, mem: float | None) -> RankSample:
    return RankSample(
        job, int(label), label, int(label), 0, ProcKey(pid, 1), 1, None, cpu, 1, 1, 1, None,
        gpu_sm_percent=sm, gpu_memory_percent=mem,
    )  # fmt: skip


def _snap(*jobs: JobSample) -> Snapshot:
    return Snapshot(0.0, 0.0, jobs, None, (), (), {}, 0, 0, 0.0, 0)


@pytest.mark.parametrize("name", ["gpu-stall.json", "gpu-stall-crossed.json"])
def test_training_never_spins_and_a_lone_collective_does(name):
    run = json.loads((DEVICE_H200 / name).read_text())
    pids = {rank: entries[0][2] for rank, entries in run["phases"].items()}
    start = {n: at for n, at, _ in run["phases"]["0"]}
    clock = [0.0]
    tracker = StallTracker(10.0, py_spy=False, clock=lambda: clock[0], wall=lambda: clock[0])
    spun: dict[str, list[tuple[float, float]]] = {label: [] for label in pids}
    for s in run["nvml_samples"]:
        cpu = s.get("cpu", {})
        if "util" not in s or any(cpu.get(str(pid)) is None for pid in pids.values()):
            continue
        clock[0] = s["at"]
        ranks = []
        for label, pid in sorted(pids.items()):
            mine = s["util"].get(str(pid), [])
            sm = sum(v[0] for v in mine) / len(mine) if mine else 0.0
            mem = sum(v[1] for v in mine) / len(mine) if mine else 0.0
            ranks.append(_rank("j", label, pid, cpu[str(pid)], sm, mem))
        job = JobSample("j", ProcKey(1, 1), None, 2, 0, 0, None, 0.0, tuple(ranks))
        for r in tracker.update(_snap(job)).jobs[0].ranks:
            if r.progress is not None:
                spun[r.rank_label].append((s["at"], r.progress.gpu_spinning_seconds))
    for label, seen in spun.items():
        training = [sec for at, sec in seen if start["big"] <= at < start["hang"]]
        assert len(training) > 60 and max(training) == 0.0, (label, max(training))
    hang = {label: [sec for at, sec in seen if at >= start["hang"] + 12] for label, seen in spun.items()}
    if name == "gpu-stall.json":  # rank 0 alone in its all_reduce: its GPU spins; rank 1 idles
        assert hang["0"] and min(hang["0"]) > 0 and max(hang["1"]) == 0.0, hang
    else:  # both spin on one GPU, each time-sliced to about half: not told (real ranks own a GPU)
        assert all(max(v) == 0.0 for v in hang.values()), hang


def _replay_stranded(sc: dict) -> list[tuple[float, dict[str, JobSample]]]:
    """The daemon's per-round view of each rank, through a fresh stall tracker and stranding
    tracker, with rank 1's death counted where the run saw it gone."""
    clock = [0.0]
    deaths: dict = {}
    stalls = StallTracker(10.0, py_spy=False, clock=lambda: clock[0], wall=lambda: clock[0])
    strands = StrandTracker(lambda: deaths, wall=lambda: clock[0], window=stalls.window)
    cpu: dict[int, float] = {}
    out = []
    last = None
    victim_job = next(j["job"] for row in sc["judged"] for j in row["jobs"] if "1" in j["ranks"])
    for row in sc["judged"]:
        if not row["jobs"]:
            continue
        at = row["at"]
        clock[0] = at
        if sc["died_at"] is not None and at >= sc["died_at"] and not deaths:
            deaths[(victim_job, "1", 0)] = ("external_signal", sc["died_at"])
        jobs = []
        for j in row["jobs"]:
            ranks = []
            for label, r in j["ranks"].items():
                if label == "1" and sc["died_at"] is not None and at >= sc["died_at"]:
                    continue  # dead: no longer a live rank of the round
                # CPU time from the daemon's own judgement of the round (busy: most of a core)
                cpu[r["pid"]] = cpu.get(r["pid"], 0.0) + (
                    0.9 * (at - last) if last and r["cpu_busy"] else 0.0
                )
                ranks.append(
                    _rank(
                        j["job"], label, r["pid"], cpu[r["pid"]], r["gpu_sm_percent"], r["gpu_memory_percent"]
                    )
                )
            run_id = j["job"].split("-")[0]
            jobs.append(
                JobSample(
                    j["job"],
                    ProcKey(hash(j["job"]) % 10000, 1),
                    run_id,
                    sc["world"],
                    0,
                    0,
                    None,
                    0.0,
                    tuple(ranks),
                )
            )
        last = at
        snap = strands.update(stalls.update(_snap(*jobs)))
        out.append((at, {j.key: j for j in snap.jobs}))
    return out


def _scenario(mode: str) -> dict:
    return next(sc for sc in STRANDED["scenarios"] if sc["mode"] == mode)


def test_a_survivor_spinning_for_a_dead_rank_on_the_h100_is_stranded_in_time():
    sc = _scenario("killed")
    rounds = _replay_stranded(sc)
    died = sc["died_at"]
    stranded = [(at, j) for at, jobs in rounds for j in jobs.values() if j.stranded is not None]
    assert stranded and min(at for at, _ in stranded) >= died + 10, "never before the death's 10 s"
    first_at, job = stranded[0]
    assert first_at - died <= 30 and job.stranded.ranks == ("0",), (first_at - died, job.stranded)
    # the run's own record: the daemon said so, 10-11 s after the death
    assert 10 <= sc["death_to_stranded_s"] <= 30 and STRANDED["scenarios"][0]["stranded_last"][0][
        "ranks"
    ] == ["0"]


def test_a_survivor_that_works_on_after_the_death_is_never_stranded():
    sc = _scenario("killed-other")
    for _, jobs in _replay_stranded(sc):
        for j in jobs.values():
            assert j.stranded is None or "2" not in j.stranded.ranks, j.stranded
    assert not any(s and "2" in s["ranks"] for s in sc["stranded_last"])
