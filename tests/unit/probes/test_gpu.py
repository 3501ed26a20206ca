"""The NVML probe against named scenarios (tests/support/fakes.py), each a state a real node can be in."""

from __future__ import annotations

import pynvml

from sidecar.probes.gpu import GpuProbe
from tests.support.fakes import GIB, scenario


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_no_library_is_a_normal_state_and_is_retried_later():
    clock = Clock()
    calls = []

    def loader():
        calls.append(1)
        raise ImportError("No module named 'pynvml'")

    probe = GpuProbe(loader=loader, clock=clock)
    r = probe.sample()
    assert not r.success and r.devices == () and "nvidia-ml-py" in r.message
    probe.sample()
    assert len(calls) == 1  # not retried on every tick
    clock.now += 61
    probe.sample()
    assert len(calls) == 2


def test_no_driver():
    r = GpuProbe(loader=scenario("no_driver")).sample()
    assert not r.success and "no NVIDIA driver" in r.message


def test_no_gpu():
    r = GpuProbe(loader=scenario("no_gpu")).sample()
    assert not r.success and "no GPU" in r.message


def test_two_gpus_processes_and_v2_memory():
    fake = scenario("two_gpus", (101, 102))()
    r = GpuProbe(loader=lambda: fake).sample()
    assert r.success and r.message is None
    assert [d.index for d in r.devices] == [0, 1]
    d0 = r.devices[0]
    assert d0.name == "NVIDIA H200" and d0.uuid == "GPU-00000000-fake"
    assert d0.used_bytes == 2 * GIB  # v2: without the driver's reservation
    assert d0.total_bytes == 143771 * (1 << 20)
    assert [(p.pid, p.used_bytes) for p in d0.processes] == [(101, 2 * GIB)]


def test_each_process_activity_since_the_last_round():
    """nvmlDeviceGetProcessUtilization: the mean of a process's samples since the newest one
    seen; no sample since is a process that ran nothing (0), a device that does not report
    it gives None and is not asked again."""
    fake = scenario("two_gpus", (101, 102))()
    fake.devices[0].utilisation = [(101, 100, 0), (101, 90, 2)]
    fake.devices[1].utilisation = None
    probe = GpuProbe(loader=lambda: fake)
    r = probe.sample()
    p0, p1 = r.devices[0].processes[0], r.devices[1].processes[0]
    assert (p0.pid, p0.sm_percent, p0.memory_percent) == (101, 95.0, 1.0)
    assert (p1.pid, p1.sm_percent, p1.memory_percent) == (102, None, None)
    r = probe.sample()  # nothing new: NVML_ERROR_NOT_FOUND
    assert (r.devices[0].processes[0].sm_percent, r.devices[0].processes[0].memory_percent) == (0.0, 0.0)
    assert r.success
    # asked from 0, then from the newest sample's stamp; device 1 once only
    assert fake.utilisation_asked == [(0, 0), (1, 0), (0, fake.stamp)]
    fake.devices[0].utilisation = [(102, 50, 50)]  # a pid that is no compute process: left out
    assert [p.sm_percent for p in probe.sample().devices[0].processes] == [0.0]


def test_the_per_process_queries_wait_for_a_detailed_round():
    """Between detailed rounds only each device's memory is asked for: its processes (their
    memory, their activity) are the last detailed round's; a lost GPU is still seen."""
    fake = scenario("two_gpus", (101, 102))()
    fake.devices[0].utilisation = [(101, 80, 0)]
    probe = GpuProbe(loader=lambda: fake)
    first = probe.sample()
    asked = len(fake.utilisation_asked)
    fake.devices[0].processes = [(101, 3 * GIB)]
    fake.devices[0].used = 3 * GIB
    fake.devices[0].utilisation = [(101, 10, 0)]
    light = probe.sample(detail=False)
    assert len(fake.utilisation_asked) == asked  # not asked
    assert light.devices[0].processes == first.devices[0].processes  # 2 GiB, 80 %: as last read
    assert light.devices[0].used_bytes == 3 * GIB  # the device's memory: this round's
    full = probe.sample()
    assert [(p.used_bytes, p.sm_percent) for p in full.devices[0].processes] == [(3 * GIB, 10.0)]
    fake.devices[1].lost_after = 0
    assert probe.sample(detail=False).devices[1].lost


def test_gpu_lost_mid_run_is_reported_and_the_other_gpu_goes_on():
    fake = scenario("gpu_lost_mid_run", (101, 102))()
    probe = GpuProbe(loader=lambda: fake)
    assert probe.sample().success and probe.sample().success
    r = probe.sample()
    assert not r.success and "GPU 1 lost" in r.message
    assert r.devices[1].lost and r.devices[1].used_bytes is None
    assert not r.devices[0].lost and r.devices[0].used_bytes == 3 * GIB


def test_unsupported_fields_are_none_not_zero():
    fake = scenario("unsupported_field", (101,))()
    r = GpuProbe(loader=lambda: fake).sample()
    assert r.success
    d = r.devices[0]
    # v2 unsupported: falls back to v1, whose "used" includes the reservation
    assert d.used_bytes == 600 << 20
    assert d.processes[0].used_bytes is None


def test_old_bindings_without_the_version_argument():
    fake = scenario("old_bindings", (101,))()
    r = GpuProbe(loader=lambda: fake).sample()
    assert r.success and r.devices[0].used_bytes == 5 * GIB + (600 << 20)


def test_close_shuts_nvml_down():
    fake = scenario("two_gpus", (1, 2))()
    probe = GpuProbe(loader=lambda: fake)
    probe.sample()
    probe.close()
    assert fake.shutdowns == 1


def test_real_bindings_on_this_machine():
    """The real nvidia-ml-py on a machine without a driver: a message, not a crash."""
    r = GpuProbe().sample()
    if r.success:  # a GPU machine
        assert r.devices
    else:
        assert r.message
    assert pynvml.NVML_ERROR_GPU_IS_LOST == 15
