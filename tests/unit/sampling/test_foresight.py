"""The trend under the OOM forecast (sidecar/sampling/foresight.py) on series with known shapes: a
leak's rate is found, a step or a steady job's noise never makes a prediction that lasts,
and the daemon-facing ``Foresight`` picks the binding limit, warns once per episode, and
again only when a forecast is news.
The real leaking jobs are in tests/e2e/test_foresight.py and benchmarks/foresight.py."""

from __future__ import annotations

import logging
import math
import random

import pytest

from sidecar.model import CgroupSample, HostSample, JobSample, MemoryCharge, ProcKey, RankSample, Snapshot
from sidecar.sampling.foresight import CONFIRM_SECONDS, WINDOWS_SECONDS, Foresight, Series, growth_rate
from sidecar.trend import theil_sen

MB = 10**6
GIB = 2**30


def _feed(values: list[tuple[float, float]]) -> list[float | None]:
    """The confirmed rate after each point, as the daemon would see it."""
    series = Series()
    out = []
    for t, v in values:
        series.add(t, v)
        out.append(series.rate)
    return out


def test_theil_sen_ignores_an_outlier() -> None:
    points = [(float(t), 10.0 * t) for t in range(10)]
    points[4] = (4.0, 1e9)
    assert theil_sen(points) == pytest.approx(10.0)


@pytest.mark.parametrize("rate", [20 * MB, 100 * MB, 500 * MB])
@pytest.mark.parametrize("interval", [1.0, 0.1])
def test_a_steady_leak_is_measured(rate: float, interval: float) -> None:
    rng = random.Random(1)
    n = int(60 / interval)
    values = [(i * interval, 4 * GIB + rate * i * interval + rng.gauss(0, 2 * MB)) for i in range(n)]
    rates = _feed(values)
    assert rates[-1] == pytest.approx(rate, rel=0.1)
    # believed only after it held for CONFIRM_SECONDS, but within ~10 s of the start
    first = next(i for i, r in enumerate(rates) if r is not None)
    assert CONFIRM_SECONDS <= values[first][0] <= 12


def test_a_leak_that_starts_late_is_found_in_the_short_window() -> None:
    values = [(float(t), 2.0 * GIB) for t in range(60)]
    values += [(60.0 + t, 2.0 * GIB + 300 * MB * t) for t in range(1, 15)]
    rates = _feed(values)
    found = [values[i][0] for i, r in enumerate(rates) if r is not None]
    assert found and found[0] - 60 <= 10
    assert rates[-1] == pytest.approx(300 * MB, rel=0.1)


@pytest.mark.parametrize("interval", [1.0, 0.25, 0.1])
@pytest.mark.parametrize("ramp_seconds", [0.0, 1.0, 2.0, min(WINDOWS_SECONDS)])
@pytest.mark.parametrize("phase", [0.0, 0.5])
def test_a_checkpoint_load_is_no_lasting_prediction(
    interval: float, ramp_seconds: float, phase: float
) -> None:
    """A step then flat: nothing confirmed, whether instant or a load that lasts up to the
    shortest window (tests/e2e/test_foresight.py counts on that bound), wherever it falls
    between two samples."""
    rng = random.Random(2)
    values = []
    began = 30 + phase * interval
    for i in range(int(120 / interval)):
        t = i * interval
        ramp = min(1.0, max(0.0, (t - began) / ramp_seconds)) if ramp_seconds else float(t >= began)
        values.append((t, 1 * GIB + 6 * GIB * ramp + rng.gauss(0, 1 * MB)))
    assert all(r is None for r in _feed(values))


@pytest.mark.parametrize("interval", [1.0, 0.25, 0.1])
@pytest.mark.parametrize("ramp_seconds", [6.0, 8.0, 12.0, 20.0])
@pytest.mark.parametrize("phase", [0.0, 0.5])
def test_a_slow_load_is_forecast_only_while_it_lasts(
    interval: float, ramp_seconds: float, phase: float
) -> None:
    """A load longer than the shortest window (memory that takes it slowly) is growth and may
    be forecast, but not once it has been over for that window (tests/e2e/test_foresight.py
    counts on that bound too)."""
    rng = random.Random(4)
    values = []
    ended = 30 + phase * interval + ramp_seconds
    for i in range(int(120 / interval)):
        t = i * interval
        ramp = min(1.0, max(0.0, (t - (ended - ramp_seconds)) / ramp_seconds))
        values.append((t, 1 * GIB + 1.5 * GIB * ramp + rng.gauss(0, 1 * MB)))
    late = [t for (t, _), r in zip(values, _feed(values), strict=True) if r is not None and t > ended]
    assert not late or max(late) - ended <= min(WINDOWS_SECONDS), late


@pytest.mark.parametrize("noise_mb", [0.1, 5.0, 200.0])
def test_a_steady_job_predicts_nothing(noise_mb: float) -> None:
    """Noise (a training step's batches come and go) and a sawtooth: never a prediction."""
    rng = random.Random(3)
    values = [(t * 0.5, 3 * GIB + rng.gauss(0, noise_mb * MB) + (t % 7) * noise_mb * MB) for t in range(1200)]
    assert all(r is None for r in _feed(values))


def test_a_staircase_leak_of_one_step_per_iteration_is_a_leak() -> None:
    """50 MB leaked once per 3 s iteration, sampled every second."""
    values = [(float(t), 1 * GIB + 50 * MB * (t // 3)) for t in range(90)]
    rate = _feed(values)[-1]
    assert rate is not None and rate == pytest.approx(50 * MB / 3, rel=0.5)


def test_a_leak_that_stops_is_forgotten_within_a_window() -> None:
    values = [(float(t), 1 * GIB + 50 * MB * min(t, 60)) for t in range(90)]
    rates = _feed(values)
    assert rates[59] is not None
    assert all(r is None for r in rates[60 + 45 // 4 + 1 :])  # a quarter of the longest window


def test_growth_rate_needs_points() -> None:
    assert growth_rate([(0.0, 1.0), (1.0, 2.0)], 1.0) is None


# -- the daemon's side ---------------------------------------------------------------------


def _rank(pid: int, unreclaimable: int, cgroup: str | None = "/job/rank") -> RankSample:
    return RankSample(
        "job", pid, str(pid), pid, 0, ProcKey(100 + pid, 1), unreclaimable, None, 1.0, 1,
        unreclaimable, 1, cgroup, tree_unreclaimable_bytes=unreclaimable,
    )  # fmt: skip


def _snap(t: float, ranks: list[RankSample], committed: int, limit: int | None, available: int) -> Snapshot:
    charge = MemoryCharge(committed, 0, 0, 0, committed, 0)
    cgroups = (
        CgroupSample("/job/rank", 1, committed, None, None, 0, 0, limited_by="/job" if limit else None,
                     effective_limit_bytes=limit, charge=charge),
        CgroupSample("/job", 1, committed, limit, None, 0, 0, limited_by="/job" if limit else None,
                     effective_limit_bytes=limit, charge=charge),
    )  # fmt: skip
    job = JobSample("job", ProcKey(1, 1), "run", 2, 0, None, "train.py", 0.0, tuple(ranks))
    host = HostSample(24 * GIB, available, 0, None, None, None, None, None, None)
    return Snapshot(1000.0 + t, t, (job,), host, (), cgroups, {}, 1, 0, 0.0, 0)


def test_a_leaking_rank_is_predicted_against_its_cgroup_limit_and_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    foresight = Foresight()
    limit = 6 * GIB
    last = None
    with caplog.at_level(logging.WARNING, logger="sidecar.foresight"):
        for t in range(40):
            leaky = 1 * GIB + 50 * MB * t
            steady = 2 * GIB
            last = foresight.update(
                _snap(float(t), [_rank(0, steady), _rank(1, leaky)], steady + leaky, limit, 20 * GIB)
            )
    assert last is not None
    r0, r1 = last.jobs[0].ranks
    assert r0.exhaustion_seconds is None  # not growing: no prediction, whatever the limit does
    assert r1.binding_limit is not None and r1.binding_limit.kind == "cgroup"
    assert r1.binding_limit.path == "/job" and r1.binding_limit.limit_bytes == limit
    room = limit - (2 * GIB + 1 * GIB + 50 * MB * 39)
    assert r1.exhaustion_seconds == pytest.approx(room / (50 * MB), rel=0.05)
    cg = {c.path: c for c in last.cgroups}
    assert cg["/job"].exhaustion_seconds == pytest.approx(room / (50 * MB), rel=0.05)
    assert cg["/job/rank"].exhaustion_seconds is None  # no limit of its own
    warned = [r for r in caplog.records if "is growing" in r.getMessage()]
    assert len(warned) == 1 and "rank 1 " in warned[0].getMessage() and "/job" in warned[0].getMessage()
    (w,) = foresight.warnings("job")
    assert w.rank == 1 and w.limit.path == "/job" and w.exhaustion_seconds > room / (50 * MB)


def test_the_host_binds_when_it_has_less_room_than_the_cgroup_limit() -> None:
    foresight = Foresight()
    last = None
    for t in range(30):
        leaky = 1 * GIB + 100 * MB * t
        last = foresight.update(_snap(float(t), [_rank(0, leaky)], leaky, 64 * GIB, 8 * GIB - 100 * MB * t))
    assert last is not None
    (r,) = last.jobs[0].ranks
    assert r.binding_limit is not None and r.binding_limit.kind == "host" and r.binding_limit.path is None
    assert r.exhaustion_seconds == pytest.approx((8 * GIB - 100 * MB * 29) / (100 * MB), rel=0.05)


def test_a_rank_without_any_limit_has_the_host_as_its_limit() -> None:
    foresight = Foresight()
    snap = foresight.update(_snap(0.0, [_rank(0, GIB, cgroup=None)], GIB, None, 20 * GIB))
    (r,) = snap.jobs[0].ranks
    assert r.binding_limit is not None and r.binding_limit.kind == "host"
    assert r.exhaustion_seconds is None


def test_a_new_episode_warns_again_after_a_quiet_gap(caplog: pytest.LogCaptureFixture) -> None:
    foresight = Foresight()
    level = 1 * GIB
    with caplog.at_level(logging.WARNING, logger="sidecar.foresight"):
        for t in range(200):
            growing = t < 40 or t >= 120
            level += 40 * MB if growing else 0
            foresight.update(_snap(float(t), [_rank(0, level)], level, 16 * GIB, 20 * GIB))
    assert len(foresight.warnings("job")) == 2


def _warn_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is growing" in r.getMessage()]


def test_a_growth_that_stopped_short_then_a_leak_are_two_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job's start (20 MB/s for 10 s toward a 4 GiB limit: minutes left at that trend,
    warned) stops; 6 s later a leak of 200 MB/s starts, which will reach the limit in ~15 s:
    the same episode (no 30 s gap), and the leak is warned about again, with the forecast it
    overrides. The leak's own forecasts agree with each other: no third warning."""
    clock = [0.0]
    foresight = Foresight(wall=lambda: 1000 + clock[0])
    level, t = 1.0 * GIB, 0.0
    with caplog.at_level(logging.WARNING, logger="sidecar.foresight"):
        while level < 4 * GIB:
            rate = 20 * MB if t < 10 else 0 if t < 16 else 200 * MB
            clock[0] = t
            level += rate * 0.5
            foresight.update(_snap(t, [_rank(0, int(level))], int(level), 4 * GIB, 20 * GIB))
            t += 0.5
    first, second = foresight.warnings("job")  # exactly two
    assert first.at < 1000 + 10 and first.exhaustion_seconds > 60, first
    assert second.at > 1000 + 16 and second.exhaustion_seconds < 20, second
    assert second.rate_bytes_per_second == pytest.approx(200 * MB, rel=0.2)
    lines = _warn_lines(caplog)
    assert len(lines) == 2 and "sooner than the last warning put it" in lines[1], lines


def test_a_steady_leak_to_its_limit_is_one_warning_however_its_forecast_jitters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Up to the limit itself, sampled every 0.1 s near it with 20 MB of noise: the forecasts
    shrink as the limit nears, never twice as fast as time passes: one warning."""
    rng = random.Random(5)
    foresight = Foresight()
    t = 0.0
    with caplog.at_level(logging.WARNING, logger="sidecar.foresight"):
        while (level := 1 * GIB + 150 * MB * t) < 4 * GIB:
            v = int(level + rng.gauss(0, 20 * MB))
            foresight.update(_snap(t, [_rank(0, v)], v, 4 * GIB, 20 * GIB))
            t += 0.1
    assert len(foresight.warnings("job")) == 1 and len(_warn_lines(caplog)) == 1


def test_a_new_trend_after_a_spent_forecast_is_warned_again(caplog: pytest.LogCaptureFixture) -> None:
    """200 MB/s for 12 s toward 8 GiB (warned: ~30 s left), then flat for 25 s (the trend is
    lost, but less than the 30 s that end an episode), then 40 MB/s: the first warning's time
    has passed without the limit, and the new, slower trend is warned about, saying so."""
    clock = [0.0]
    foresight = Foresight(wall=lambda: 1000 + clock[0])
    level, t = 1.0 * GIB, 0.0
    with caplog.at_level(logging.WARNING, logger="sidecar.foresight"):
        while t < 90:
            clock[0] = t
            level += (200 * MB if t < 12 else 0 if t < 37 else 40 * MB) * 0.5
            foresight.update(_snap(t, [_rank(0, int(level))], int(level), 8 * GIB, 20 * GIB))
            t += 0.5
    first, second = foresight.warnings("job")
    assert second.at >= first.at + first.exhaustion_seconds + 10 and second.at > 1000 + 37, (first, second)
    assert second.rate_bytes_per_second == pytest.approx(40 * MB, rel=0.2)
    assert "a new trend: the last warning put it" in _warn_lines(caplog)[1]


def test_a_growth_that_slows_toward_a_level_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A cache filling up: 3 GiB more approached exponentially (50 MB/s at first, a 60 s time
    constant) under a 6 GiB limit it never reaches. Each forecast puts the limit later than
    the last; the first one's time passes while the trend holds: one warning."""
    foresight = Foresight()
    t = 0.0
    with caplog.at_level(logging.WARNING, logger="sidecar.foresight"):
        while t < 300:
            v = int(1 * GIB + 3 * GIB * (1 - math.exp(-t / 60)))
            foresight.update(_snap(t, [_rank(0, v)], v, 6 * GIB, 20 * GIB))
            t += 0.5
    assert len(foresight.warnings("job")) == 1 and len(_warn_lines(caplog)) == 1, _warn_lines(caplog)


def test_a_rank_is_judged_only_while_its_limit_grows_and_confirmed_with_it() -> None:
    """A rank growing under a limit whose charge does not grow (another process frees as
    much) is not judged: its trend is kept, not evaluated. Once the limit's charge grows
    too, the rank's prediction comes in the same round as the limit's confirmation."""
    foresight = Foresight()
    judged = []
    series_of = foresight._ranks
    first_prediction = first_limit = None
    for t in range(60):
        leaky = 1 * GIB + 50 * MB * t
        committed = 4 * GIB if t < 30 else 4 * GIB + 50 * MB * (t - 30)  # flat, then growing
        snap = foresight.update(_snap(float(t), [_rank(0, leaky)], committed, 8 * GIB, 20 * GIB))
        (r,) = snap.jobs[0].ranks
        judged.append(series_of[r.key].growing_since is not None)
        cg = {c.path: c for c in snap.cgroups}["/job"]
        if t < 30:
            assert r.exhaustion_seconds is None and cg.exhaustion_seconds is None
        if first_prediction is None and r.exhaustion_seconds is not None:
            first_prediction = t
        if first_limit is None and cg.exhaustion_seconds is not None:
            first_limit = t
    assert not any(judged[:30]), "a rank is judged while its limit's charge is flat"
    assert first_prediction is not None and first_prediction == first_limit
