"""The stall rule on synthetic snapshots with a fake clock (the real hang is in
tests/test_e2e_run.py): idle means under 5 % of a core over a window of seconds."""

from __future__ import annotations

from sidecar.model import JobSample, ProcKey, RankSample, Snapshot
from sidecar.stalls import StallTracker


def _snap(cpu: dict[int, float]) -> Snapshot:
    ranks = tuple(
        RankSample("j", pid, str(pid), pid, 0, ProcKey(100 + pid, 1), 1, None, c, 1, 1, 1, None)
        for pid, c in cpu.items()
    )
    job = JobSample("j", ProcKey(99, 1), None, len(ranks), 0, 0, None, 0.0, ranks)
    return Snapshot(0.0, 0.0, (job,), None, (), (), {}, 0, 0, 0.0, 0)


def test_stalled_only_when_every_rank_idles_long_enough():
    now = [0.0]
    t = StallTracker(6.0, clock=lambda: now[0])
    assert t.window == 3.0
    cpu = {0: 10.0, 1: 10.0}
    stalled = []
    for step in range(40):  # 0.5 s rounds
        now[0] = step * 0.5
        if step < 10:  # both work for 5 s
            cpu = {r: c + 0.4 for r, c in cpu.items()}
        elif step < 20:  # rank 1 works, rank 0 waits
            cpu = {0: cpu[0] + 0.005, 1: cpu[1] + 0.4}
        else:  # both idle, a 10 ms tick now and then (background threads)
            cpu = {r: c + (0.01 if step % 4 == 0 else 0.0) for r, c in cpu.items()}
        stalled.append(t.update(_snap(cpu))["j"])
    assert max(stalled[:20]) == 0.0  # one busy rank is progress
    # idle from t=10 s: judged over the 3 s window, so the count starts once it covers idling
    assert stalled[25] > 0 and stalled[-1] >= 6.0
    assert stalled[-1] - stalled[-2] == 0.5
    # work again: back to 0, and a new rank (a restart) is progress by definition
    now[0] += 0.5
    assert t.update(_snap({0: cpu[0] + 1.0, 1: cpu[1]}))["j"] == 0.0
    now[0] += 10
    assert t.update(_snap({0: cpu[0] + 1.0, 1: cpu[1], 2: 0.0}))["j"] == 0.0
