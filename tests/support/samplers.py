"""A sampler over the captured /proc tree of a real torchrun job (tests/fixtures/proc-torchrun),
with the memory cgroups of its hybrid host written beside it and a named NVML scenario, and
the fake clock it can run on."""

from __future__ import annotations

from pathlib import Path

from sidecar.daemon import Sampler
from sidecar.probes.cgroup import CgroupReader
from sidecar.probes.gpu import GpuProbe
from sidecar.settings import Settings
from tests.conftest import RANK0, RANK1
from tests.support import cgtrees
from tests.support.cgtrees import MIB, MOUNTINFO_HYBRID
from tests.support.fakes import scenario

CAPTURED_CGROUP = "/process_api/4cc2bd1f19415a34a23bde4655541313"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sampler_settings(proc_tree: Path, tmp_path: Path) -> Settings:
    return Settings(proc_root=str(proc_tree), shm_path=str(tmp_path), postmortem_dir=str(tmp_path / "pm"))


def make_sampler(
    proc_tree: Path, tmp_path: Path, gpu: str = "no_driver", clock: Clock | None = None
) -> Sampler:
    cgtrees.write(
        tmp_path / "sys/fs/cgroup/memory", "/", cgtrees.v1_level(cgtrees.V1_UNLIMITED, 9000 * MIB, 9100 * MIB)
    )
    cgtrees.write(
        tmp_path / "sys/fs/cgroup/memory",
        "/process_api",
        cgtrees.v1_level(str(8192 * MIB), 2000 * MIB, 2100 * MIB),
    )
    cgtrees.write(
        tmp_path / "sys/fs/cgroup/memory",
        CAPTURED_CGROUP,
        cgtrees.v1_level(cgtrees.V1_UNLIMITED, 1800 * MIB, 1900 * MIB, oom_kill=0),
    )
    kwargs = {"clock": clock} if clock else {}
    return Sampler(
        sampler_settings(proc_tree, tmp_path),
        gpu=GpuProbe(loader=scenario(gpu, (RANK0, RANK1))),
        cgroups=CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path)),
        **kwargs,
    )
