"""Discovery and sampling on the captured /proc tree of a real torchrun job, edited to
simulate what happens next (a worker between fork and exec, pid reuse, a restart)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sidecar.daemon import Sampler
from sidecar.probes.cgroup import CgroupReader
from sidecar.probes.proc import ProcReader, parse_stat, parse_status
from sidecar.sampling.children import relaunched
from sidecar.sampling.discovery import Discovery
from sidecar.sampling.jobs import job_key_for, launcher_of_argv
from sidecar.sampling.spawned import SPAWN_JOIN_SECONDS, is_spawned, joined_group
from tests.conftest import (
    AGENT,
    FIXTURES,
    KTHREADD,
    RANK0,
    RANK0_WORKERS,
    RANK1,
    RANK1_WORKERS,
    RUN_ID,
    SHELL,
)
from tests.support.cgtrees import MIB, MOUNTINFO_HYBRID
from tests.support.fakes import GIB
from tests.support.samplers import CAPTURED_CGROUP, Clock, make_sampler, sampler_settings
from tests.support.skips import met, skip


@pytest.mark.parametrize(
    "argv, expected",
    [
        (("/opt/venv/bin/python", "/opt/venv/bin/torchrun", "--standalone", "train.py"), True),
        (("torchrun", "--nproc-per-node=8", "train.py"), True),
        (("/usr/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py"), True),
        (("python", "-u", "-m", "torch.distributed.launch", "--use-env", "t.py"), True),
        (("python", "-mtorch.distributed.run", "t.py"), True),
        (("python", "train.py", "--torchrun"), False),
        (("python", "-m", "torch.distributed.elastic.agent"), False),
        (("bash", "-c", "sleep 1"), False),
        ((), False),
    ],
)
def test_agent_launch_forms(argv, expected):
    assert (launcher_of_argv(argv) == "torchrun") is expected


def test_job_keys():
    assert job_key_for(RUN_ID, 77) == "8d6de2d1"
    assert job_key_for("none", 77) == "77"  # torchrun's default --rdzv-id
    assert job_key_for(None, 77) == "77"
    assert job_key_for("llama-sft", 77) == "llama-sft"


def test_finds_the_job_its_ranks_and_their_trees(proc_tree):
    d = Discovery(ProcReader(str(proc_tree)))
    jobs = d.tick()
    assert len(jobs) == 1
    job = jobs[0]
    assert job.agent.pid == AGENT and job.key == "8d6de2d1" and job.run_id == RUN_ID
    assert job.world_size == 2 and job.restart_count == 0 and job.entrypoint == "tests/workloads/rank.py"
    by_rank = {r.rank: pid for pid, r in job.ranks.items()}
    assert by_rank == {0: RANK0, 1: RANK1}
    assert sorted(d.tree(RANK0)) == sorted((RANK0, *RANK0_WORKERS))
    assert sorted(d.tree(RANK1)) == sorted((RANK1, *RANK1_WORKERS))
    assert d.entries[KTHREADD].kind == "kthread" and d.entries[SHELL].kind == "other"


def test_pid_filter(proc_tree):
    assert Discovery(ProcReader(str(proc_tree)), pids=[AGENT]).tick()
    assert Discovery(ProcReader(str(proc_tree)), pids=[1]).tick()  # an ancestor of the agent
    assert not Discovery(ProcReader(str(proc_tree)), pids=[SHELL]).tick()


def _edit(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new))


def _fork_child(proc_tree: Path, parent: int, pid: int, start_ticks: int, *, env_from: int | None) -> None:
    """A new process dir: a copy of ``parent`` (fork), with its own pid and start time."""
    src, dst = proc_tree / str(parent), proc_tree / str(pid)
    dst.mkdir()
    for name in ("stat", "status", "cmdline", "cgroup", "environ"):
        (dst / name).write_bytes((src / name).read_bytes())
    fields = (dst / "stat").read_bytes().split(b" ")
    fields[0], fields[3], fields[21] = str(pid).encode(), str(parent).encode(), str(start_ticks).encode()
    (dst / "stat").write_bytes(b" ".join(fields))
    _edit(
        dst / "status",
        f"PPid:\t{parse_status((src / 'status').read_bytes()).ppid}".encode(),
        f"PPid:\t{parent}".encode(),
    )
    if env_from is not None:
        (dst / "environ").write_bytes((proc_tree / str(env_from) / "environ").read_bytes())


def test_new_job_after_start_and_a_worker_caught_before_exec(proc_tree):
    clock = Clock()
    d = Discovery(ProcReader(str(proc_tree)), clock=clock)
    assert len(d.tick()) == 1
    # A second agent appears (copy of the first), then a child forked but not yet exec'd:
    # comm is still pt_elastic and the environment is the agent's.
    _fork_child(proc_tree, SHELL, 5000, 90000, env_from=AGENT)
    (proc_tree / "5000" / "cmdline").write_bytes((proc_tree / str(AGENT) / "cmdline").read_bytes())
    _edit(proc_tree / "5000" / "stat", b"(bash)", b"(pt_elastic)")
    _fork_child(proc_tree, 5000, 5001, 90100, env_from=5000)
    jobs = d.tick()
    assert [j.agent.pid for j in jobs] == [AGENT, 5000]
    second = jobs[1]
    assert second.ranks == {} and d.entries[5001].kind == "pending"
    # exec: the worker environment appears (another run id, so another job key)
    env = (
        (proc_tree / str(RANK0) / "environ")
        .read_bytes()
        .replace(RUN_ID.encode(), b"0badc0de-1111-2222-3333-444455556666")
    )
    (proc_tree / "5001" / "environ").write_bytes(env)
    _edit(proc_tree / "5001" / "stat", b"(pt_elastic)", b"(python3)")
    clock.now += 0.5
    jobs = d.tick()
    assert jobs[1].key == "0badc0de" and set(jobs[1].ranks) == {5001}


def test_two_agents_with_the_same_run_id_do_not_collide(proc_tree):
    d = Discovery(ProcReader(str(proc_tree)))
    d.tick()
    _fork_child(proc_tree, SHELL, 6000, 95000, env_from=AGENT)
    _edit(proc_tree / "6000" / "stat", b"(bash)", b"(pt_elastic)")
    _fork_child(proc_tree, 6000, 6001, 95100, env_from=RANK0)
    keys = [j.key for j in d.tick()]
    assert keys == ["8d6de2d1", "8d6de2d1-6000"]


def test_sampler_reads_ranks_trees_cgroups_and_host(proc_tree, tmp_path):
    snap = make_sampler(proc_tree, tmp_path).sample()
    (job,) = snap.jobs
    r0, r1 = job.ranks
    assert (r0.rank, r1.rank) == (0, 1)
    status0 = parse_status((proc_tree / str(RANK0) / "status").read_bytes())
    assert r0.rss_bytes == status0.rss_bytes and r0.peak_rss_bytes == status0.peak_rss_bytes
    worker_rss = sum(parse_stat((proc_tree / str(w) / "stat").read_bytes()).rss_bytes for w in RANK0_WORKERS)
    assert r0.tree_rss_bytes == status0.rss_bytes + worker_rss and r0.tree_processes == 3
    assert r0.cgroup == CAPTURED_CGROUP
    cgroups = {c.path: c for c in snap.cgroups}
    assert cgroups[CAPTURED_CGROUP].limited_by == "/process_api"
    assert cgroups[CAPTURED_CGROUP].effective_limit_bytes == 8192 * MIB
    assert cgroups["/process_api"].usage_bytes == 2000 * MIB  # the binding ancestor is sampled too
    assert snap.host is not None and snap.host.total_bytes == 24683584 * 1024
    assert snap.probes["gpu"].success is False and snap.probes["proc"].success
    assert r0.gpu_memory_bytes == {}


def test_gpu_memory_is_attributed_to_ranks(proc_tree, tmp_path):
    snap = make_sampler(proc_tree, tmp_path, gpu="two_gpus").sample()
    r0, r1 = snap.jobs[0].ranks
    assert r0.gpu_memory_bytes == {0: 2 * GIB} and r1.gpu_memory_bytes == {1: 3 * GIB}
    assert snap.nvml_unmatched_pids == ()


def test_gpu_pids_of_another_namespace_are_reported(proc_tree, tmp_path, caplog):
    sampler = make_sampler(proc_tree, tmp_path, gpu="foreign_pids")
    snap = sampler.sample()
    sampler.sample()
    assert snap.nvml_unmatched_pids == (4_000_000,)
    warnings = [r for r in caplog.records if "PID namespace" in r.getMessage()]
    assert len(warnings) == 1  # once, with the advice
    assert "hostPID" in warnings[0].getMessage()


def test_rank_in_a_container_keeps_its_namespaced_pid(proc_tree, tmp_path):
    _edit(proc_tree / str(RANK0) / "status", f"NSpid:\t{RANK0}".encode(), f"NSpid:\t{RANK0}\t17".encode())
    snap = make_sampler(proc_tree, tmp_path, gpu="two_gpus").sample()
    r0 = snap.jobs[0].ranks[0]
    assert r0.ns_pids == (RANK0, 17) and r0.gpu_memory_bytes == {0: 2 * GIB}


def test_pid_reuse_is_not_the_same_rank(proc_tree, tmp_path):
    sampler = make_sampler(proc_tree, tmp_path)
    assert len(sampler.sample().jobs[0].ranks) == 2
    # rank 1 exits and its pid is reused by a shell's child, with another start time
    for w in RANK1_WORKERS:
        for f in (proc_tree / str(w)).iterdir():
            f.unlink()
        (proc_tree / str(w)).rmdir()
    for f in (proc_tree / str(RANK1)).iterdir():
        f.unlink()
    (proc_tree / str(RANK1)).rmdir()
    _fork_child(proc_tree, SHELL, RANK1, 999999, env_from=None)
    snap = sampler.sample()
    assert [r.rank for r in snap.jobs[0].ranks] == [0]
    snap = sampler.sample()
    assert [r.rank for r in snap.jobs[0].ranks] == [0]
    assert sampler.discovery.entries[RANK1].kind == "other"


def test_zombie_rank_is_not_live(proc_tree, tmp_path):
    sampler = make_sampler(proc_tree, tmp_path)
    sampler.sample()
    fields = (proc_tree / str(RANK1) / "stat").read_bytes().split(b" ")
    fields[2] = b"Z"
    (proc_tree / str(RANK1) / "stat").write_bytes(b" ".join(fields))
    assert [r.rank for r in sampler.sample().jobs[0].ranks] == [0]


def test_agent_gone_detaches_the_job(proc_tree, tmp_path):
    sampler = make_sampler(proc_tree, tmp_path)
    sampler.sample()
    import shutil

    for pid in (AGENT, RANK0, RANK1, *RANK0_WORKERS, *RANK1_WORKERS):
        shutil.rmtree(proc_tree / str(pid))
    assert sampler.sample().jobs == ()


def test_an_agent_that_exited_is_not_found_again_while_it_is_a_zombie(proc_tree, tmp_path):
    """With the connector, an exit is heard when it happens; the process stays in /proc as a
    zombie (named pt_elastic still, its cmdline empty) until its parent reaps it. The next
    listing of /proc must not take that corpse for a new agent (a job with no ranks)."""
    clock = Clock()
    events: list[tuple[str, int, int]] = []

    def feed() -> tuple[list[tuple[str, int, int]], bool]:
        out = list(events)
        events.clear()
        return out, False

    sampler = make_sampler(proc_tree, tmp_path, clock=clock)
    sampler.discovery.listen(feed, lambda pids: None)
    assert len(sampler.sample().jobs[0].ranks) == 2
    for pid in (RANK0, RANK1, *RANK0_WORKERS, *RANK1_WORKERS):
        shutil.rmtree(proc_tree / str(pid))
    stat = proc_tree / str(AGENT) / "stat"
    head, rest = stat.read_bytes().split(b") ", 1)
    fields = rest.split(b" ")
    fields[0], fields[17] = b"Z", b"1"  # a zombie: its state, and one thread (field 20)
    stat.write_bytes(head + b") " + b" ".join(fields))
    (proc_tree / str(AGENT) / "cmdline").write_bytes(b"")
    events.extend(("exit", pid, 0) for pid in (RANK0, RANK1, AGENT))
    clock.now += 0.1
    assert sampler.sample().jobs == ()
    for _ in range(3):  # past the next listings of /proc
        clock.now += 5.0
        assert sampler.sample().jobs == ()
    assert AGENT not in sampler.discovery.jobs


def test_unreadable_environment_is_reported_once_and_ranks_inferred(proc_tree, tmp_path, caplog):
    if not met("root"):
        skip("root", "to make a file unreadable for a child")
    d = Discovery(ProcReader(str(proc_tree)))

    def denied(pid: int) -> dict[str, str]:
        from sidecar.errors import AccessDenied

        raise AccessDenied(f"/proc/{pid}/environ: permission denied")

    d.reader.environ = denied  # type: ignore[method-assign]
    jobs = d.tick()
    d.tick()
    assert sorted(r.label for r in jobs[0].ranks.values()) == ["local0", "local1"]
    assert {r.rank_source for r in jobs[0].ranks.values()} == {"order"}  # where the number came from
    assert len(d.unreadable) == 2
    msgs = [r for r in caplog.records if "cannot read the environment" in r.getMessage()]
    assert len(msgs) == 2 and "CAP_SYS_PTRACE" in msgs[0].getMessage()


def _shell_start_seconds(proc_tree: Path) -> float:
    from sidecar.probes.proc import TICKS_PER_SECOND

    return parse_stat((proc_tree / str(SHELL) / "stat").read_bytes()).start_ticks / TICKS_PER_SECOND


def _exec_torchrun(proc_tree: Path, pid: int, comm: bytes) -> None:
    """The process execs torchrun: new argv, new comm, same pid and start time."""
    (proc_tree / str(pid) / "cmdline").write_bytes(
        b"/usr/bin/python3\0/usr/local/bin/torchrun\0--standalone\0t.py\0"
    )
    _edit(proc_tree / str(pid) / "stat", b"(bash)", b"(" + comm + b")")


def test_a_young_process_that_execs_torchrun_is_found_on_the_next_tick(proc_tree):
    clock = Clock()
    start = _shell_start_seconds(proc_tree)
    d = Discovery(ProcReader(str(proc_tree)), clock=clock, uptime=lambda: start + 2.0)
    d.tick()
    assert d.entries[SHELL].kind == "other"
    _exec_torchrun(proc_tree, SHELL, b"bash")  # comm unchanged: only the argv tells
    clock.now += 1
    assert SHELL in {j.agent.pid for j in d.tick()}


def test_a_process_caught_in_the_middle_of_exec_is_not_given_up(proc_tree):
    """Between execve()'s switch to the new memory and the copy of the arguments, the
    cmdline reads empty: that is not a kernel thread, and the agent it becomes is found."""
    clock = Clock()
    start = _shell_start_seconds(proc_tree)
    d = Discovery(ProcReader(str(proc_tree)), clock=clock, uptime=lambda: start + 2.0)
    (proc_tree / str(SHELL) / "cmdline").write_bytes(b"")
    d.tick()
    assert d.entries[SHELL].kind == "other"
    _exec_torchrun(proc_tree, SHELL, b"bash")
    clock.now += 1
    assert SHELL in {j.agent.pid for j in d.tick()}


def test_an_old_process_that_execs_torchrun_is_found_by_the_sweep(proc_tree):
    clock = Clock()
    start = _shell_start_seconds(proc_tree)
    d = Discovery(ProcReader(str(proc_tree)), clock=clock, uptime=lambda: start + 3600.0)
    d.tick()
    _exec_torchrun(proc_tree, SHELL, b"python3")
    clock.now += 1
    assert SHELL not in {j.agent.pid for j in d.tick()}  # old processes are not re-read every tick
    clock.now += 5
    assert SHELL in {j.agent.pid for j in d.tick()}


def test_ranks_that_outlive_their_agent_stay_watched(proc_tree, tmp_path):
    import shutil

    sampler = make_sampler(proc_tree, tmp_path)
    sampler.sample()
    shutil.rmtree(proc_tree / str(AGENT))  # the agent is killed; its workers are their own sessions
    snap = sampler.sample()
    (job,) = snap.jobs
    assert not job.agent_alive and [r.rank for r in job.ranks] == [0, 1]
    for pid in (RANK0, RANK1, *RANK0_WORKERS, *RANK1_WORKERS):
        shutil.rmtree(proc_tree / str(pid))
    assert sampler.sample().jobs == ()


def test_a_cgroup_lingers_after_its_last_rank_so_its_oom_kill_is_scraped(proc_tree, tmp_path):
    """The kill that empties a cgroup must still reach a scrape: its series stay for
    CGROUP_LINGER_SECONDS after the last rank left, and go when the cgroup is removed."""
    import shutil

    from sidecar.daemon import CGROUP_LINGER_SECONDS

    clock = Clock()
    sampler = make_sampler(proc_tree, tmp_path, clock=clock)
    assert CAPTURED_CGROUP in {c.path for c in sampler.sample().cgroups}
    for pid in (AGENT, RANK0, RANK1, *RANK0_WORKERS, *RANK1_WORKERS):
        shutil.rmtree(proc_tree / str(pid))
    level = tmp_path / "sys/fs/cgroup/memory" / CAPTURED_CGROUP.lstrip("/")
    (level / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    clock.now += 5
    snap = sampler.sample()
    assert snap.jobs == ()
    cgroups = {c.path: c for c in snap.cgroups}
    assert cgroups[CAPTURED_CGROUP].oom_kills == 1 and "/process_api" in cgroups
    clock.now += CGROUP_LINGER_SECONDS + 1
    assert sampler.sample().cgroups == ()


def test_a_removed_cgroup_does_not_linger(proc_tree, tmp_path):
    import shutil

    clock = Clock()
    sampler = make_sampler(proc_tree, tmp_path, clock=clock)
    sampler.sample()
    for pid in (AGENT, RANK0, RANK1, *RANK0_WORKERS, *RANK1_WORKERS):
        shutil.rmtree(proc_tree / str(pid))
    shutil.rmtree(tmp_path / "sys/fs/cgroup/memory" / CAPTURED_CGROUP.lstrip("/"))
    clock.now += 5
    snap = sampler.sample()
    assert snap.cgroups == () and snap.probes["cgroup"].success


def test_a_round_between_detailed_ones_reads_every_usage_and_nothing_else(proc_tree, tmp_path):
    """Between detailed rounds the cgroups' usage (the rank's and its limited ancestors')
    is read afresh and their other files are as last read; a detailed round reads them all."""
    clock = Clock()
    sampler = make_sampler(proc_tree, tmp_path, clock=clock)
    first = sampler.sample()
    assert first.detail
    root = tmp_path / "sys/fs/cgroup/memory"
    (root / CAPTURED_CGROUP.lstrip("/") / "memory.usage_in_bytes").write_text(f"{1850 * MIB}\n")
    (root / "process_api" / "memory.usage_in_bytes").write_text(f"{2050 * MIB}\n")
    (root / "process_api" / "memory.max_usage_in_bytes").write_text(f"{2222 * MIB}\n")
    clock.now += 0.1
    light = sampler.sample()
    assert not light.detail
    by = {c.path: c for c in light.cgroups}
    assert by[CAPTURED_CGROUP].usage_bytes == 1850 * MIB
    assert by["/process_api"].usage_bytes == 2050 * MIB
    assert by["/process_api"].peak_bytes == 2100 * MIB  # not read between detailed rounds
    (root / CAPTURED_CGROUP.lstrip("/") / "memory.usage_in_bytes").write_text(f"{1950 * MIB}\n")
    clock.now += 0.1
    by = {c.path: c for c in sampler.sample().cgroups}
    assert by[CAPTURED_CGROUP].peak_bytes == 1950 * MIB  # a peak is never below the usage
    clock.now += 1.0
    full = {c.path: c for c in sampler.sample().cgroups}
    assert full["/process_api"].peak_bytes == 2222 * MIB
    # growing fast toward its limit (over 5 % of it since the last full read): read in full
    # between detailed rounds too
    leaf = root / CAPTURED_CGROUP.lstrip("/")
    (leaf / "memory.usage_in_bytes").write_text(f"{2400 * MIB}\n")
    (leaf / "memory.max_usage_in_bytes").write_text(f"{3000 * MIB}\n")
    clock.now += 0.1
    fast = sampler.sample()
    assert not fast.detail
    by = {c.path: c for c in fast.cgroups}
    assert (by[CAPTURED_CGROUP].usage_bytes, by[CAPTURED_CGROUP].peak_bytes) == (2400 * MIB, 3000 * MIB)


def test_nvml_turned_off_is_never_loaded_and_has_no_probe_series(proc_tree, tmp_path):
    """--disable nvml: the GPU probe is neither loaded nor reported (no probe_success 0 that
    would read as a failure); the GPUs a working NVML shows are not sampled."""
    import dataclasses

    on = make_sampler(proc_tree, tmp_path, gpu="two_gpus").sample()
    assert on.probes["gpu"].success and on.gpus
    settings = dataclasses.replace(sampler_settings(proc_tree, tmp_path), disabled=frozenset({"nvml"}))
    off = Sampler(settings, cgroups=CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path))).sample()
    assert "gpu" not in off.probes and not off.gpus
    assert off.probes["proc"].success


def _copy(tmp_path: Path, capture: str) -> Path:
    """A copy of a captured /proc tree (fixtures/README.md), for a test to read or change."""
    root = tmp_path / "proc"
    shutil.copytree(FIXTURES / capture, root)
    return root


# The capture in fixtures/proc-deepspeed: DeepSpeed's runner, its per-node launcher, two ranks
# and one forked worker each (fixtures/README.md).
DS_RUNNER, DS_LAUNCHER, DS_RANK0, DS_RANK1, DS_WORKER0, DS_WORKER1 = 32635, 32638, 32640, 32641, 32651, 32652


@pytest.mark.parametrize(
    "argv, expected",
    [
        (("/opt/venv/bin/python", "/opt/venv/bin/torchrun", "train.py"), "torchrun"),
        (("python", "-m", "torch.distributed.run", "t.py"), "torchrun"),
        (
            ("/usr/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "t.py"),
            "deepspeed",
        ),
        (("python", "-mdeepspeed.launcher.launch", "t.py"), "deepspeed"),
        # the runner (the `deepspeed` command) starts the launcher; it is not one itself
        (("/opt/venv/bin/python", "/opt/venv/bin/deepspeed", "--num_gpus", "2", "t.py"), None),
        (("python", "-m", "deepspeed.launcher.runner", "t.py"), None),
        (("python", "train.py", "-m", "deepspeed.launcher.launch"), None),  # the script's argument
        (("python", "-X", "dev", "-m", "torch.distributed.run", "t.py"), "torchrun"),
        # MPI's starters, whatever they run (torchrun included)
        (("mpirun", "-np", "2", "python", "t.py"), "mpi"),
        (("/usr/bin/mpirun", "torchrun", "t.py"), "mpi"),
        (("orted", "-mca", "ess", "env"), "mpi"),
        (("/opt/mpich/bin/hydra_pmi_proxy", "--control-port", "n0:1"), "mpi"),
        (("python", "mpirun.py"), None),
        # Debian's alternatives: each implementation's starters by the name they were run by
        (("mpirun.openmpi", "-np", "2", "python", "t.py"), "mpi"),
        (("/usr/bin/mpiexec.mpich", "-n", "2", "python", "t.py"), "mpi"),
        (("mpiexec.hydra", "-n", "2", "t"), "mpi"),
        (("/usr/bin/mpirun-wrapper", "t"), None),
    ],
)
def test_launcher_forms(argv, expected):
    assert launcher_of_argv(argv) == expected


def test_a_deepspeed_launch_is_a_job_its_ranks_by_their_rank_variable(tmp_path):
    """DeepSpeed's per-node launcher is the job's launching process; its children with RANK
    are its ranks, their forked workers part of their trees; the runner above it is not a
    job. The job's key is the launcher's pid (no run id), its launcher 'deepspeed'."""
    root = _copy(tmp_path, "proc-deepspeed")
    d = Discovery(ProcReader(str(root)))
    (job,) = d.tick()
    assert job.agent.pid == DS_LAUNCHER and job.launcher == "deepspeed" and job.key == str(DS_LAUNCHER)
    assert job.world_size == 2 and job.run_id is None and job.entrypoint == "tests/workloads/rank.py"
    ranks = {r.rank: (pid, r.rank_source) for pid, r in job.ranks.items()}
    assert ranks == {0: (DS_RANK0, "RANK"), 1: (DS_RANK1, "RANK")}
    assert d.tree(DS_RANK0) == [DS_RANK0, DS_WORKER0] and d.tree(DS_RANK1) == [DS_RANK1, DS_WORKER1]
    assert d.entries[DS_RUNNER].kind == "other"


def test_a_child_of_deepspeed_s_launcher_without_rank_is_no_rank(tmp_path):
    """A child of the launcher that still has the launcher's own environment (between its
    fork and its exec) waits; it is no rank until its environment says RANK."""
    root = _copy(tmp_path, "proc-deepspeed")
    (root / str(DS_RANK1) / "environ").write_bytes((root / str(DS_LAUNCHER) / "environ").read_bytes())
    d = Discovery(ProcReader(str(root)))
    (job,) = d.tick()
    assert set(job.ranks) == {DS_RANK0} and d.entries[DS_RANK1].kind == "pending"


# The capture in fixtures/proc-spawn: a script calling torch.multiprocessing.spawn, its
# resource tracker, two spawned ranks in a gloo group and two spawn-context workers each.
SP_PARENT, SP_TRACKER, SP_RANK0, SP_RANK1 = 29836, 29838, 29839, 29840
SP_WORKERS = {SP_RANK0: [29850, 29851], SP_RANK1: [29852, 29853]}
SP_STARTED = 1708001 / 100  # the ranks' start, s after boot (their stat's field 22)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (("/usr/bin/python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=4, "
          "pipe_handle=6)", "--multiprocessing-fork"), True),
        (("python", "-B", "-s", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(9)",
          "--multiprocessing-fork"), True),
        # the resource tracker, the forkserver, a script that mentions the flag
        (("python", "-c", "from multiprocessing.resource_tracker import main;main(3)"), False),
        (("python", "-c", "from multiprocessing.forkserver import main", "--multiprocessing-fork"), False),
        (("python", "train.py", "--multiprocessing-fork"), False),
        ((), False),
    ],
)  # fmt: skip
def test_spawned_forms(argv, expected):
    assert is_spawned(argv) == expected


def test_a_process_group_is_known_by_its_threads():
    assert joined_group(["python", "pt_gloo_runloop"]) and joined_group(["pt_nccl_watchdg"])
    assert joined_group(["pt_tcpstore_uv"]) and not joined_group(["python", "pt_autograd_0", "pool-1"])


def _spawn_tree(tmp_path, grouped: bool = True):
    root = _copy(tmp_path, "proc-spawn")
    if not grouped:  # the same tree, no child in a process group: a pool of the spawn context
        for comm in root.glob("*/task/*/comm"):
            comm.write_bytes(b"python\n")
    return root


def test_an_mp_spawn_launch_is_a_job_its_ranks_numbered_by_their_order(tmp_path):
    """The script that called spawn is the job's launching process; its spawned children in a
    process group are its ranks, numbered by their order (nothing in their environment says
    they are ranks); their own spawn-context workers are part of their trees, never ranks;
    the resource tracker is nothing."""
    d = Discovery(ProcReader(str(_spawn_tree(tmp_path))))
    (job,) = d.tick()
    assert job.agent.pid == SP_PARENT and job.launcher == "spawn" and job.key == str(SP_PARENT)
    assert job.entrypoint == "/work/main/tests/workloads/spawned.py" and job.run_id is None
    ranks = {pid: (r.label, r.rank, r.local_rank, r.rank_source) for pid, r in job.ranks.items()}
    assert ranks == {SP_RANK0: ("local0", None, 0, "order"), SP_RANK1: ("local1", None, 1, "order")}
    for rank, workers in SP_WORKERS.items():
        assert d.tree(rank) == [rank, *workers]
    assert d.entries[SP_TRACKER].kind == "other"


def test_spawned_children_with_a_rank_in_their_inherited_environment_are_numbered_by_order(tmp_path):
    """A spawned child's environment is its parent's: a RANK there (the parent's own, from a
    wrapper) is not the child's number."""
    root = _spawn_tree(tmp_path)
    for pid in (SP_PARENT, SP_RANK0, SP_RANK1):
        (root / str(pid) / "environ").write_bytes(b"RANK=7\0LOCAL_RANK=3\0WORLD_SIZE=16\0")
    (job,) = Discovery(ProcReader(str(root))).tick()
    assert {r.label: (r.rank, r.local_rank) for r in job.ranks.values()} == {
        "local0": (None, 0),
        "local1": (None, 1),
    }
    assert job.world_size is None


def test_spawned_children_outside_a_process_group_are_no_ranks(tmp_path):
    """Children of the spawn context that never join a group (DataLoader workers, a pool)
    wait while young, then are nothing; their parent is no job."""
    now = [SP_STARTED + 5]
    d = Discovery(ProcReader(str(_spawn_tree(tmp_path, grouped=False))), uptime=lambda: now[0])
    assert d.tick() == []
    assert d.entries[SP_RANK0].kind == "spawned" and d.entries[SP_PARENT].kind == "other"
    now[0] = SP_STARTED + SPAWN_JOIN_SECONDS + 1
    assert d.tick() == []
    assert d.entries[SP_RANK0].kind == "other" and d.entries[SP_RANK1].kind == "other"


def test_a_spawned_child_joins_its_group_later(tmp_path):
    """A spawned child found before its imports end becomes a rank at the listing after it
    joined its group, with the index of its start."""
    root = _spawn_tree(tmp_path)
    comms = {p: (root / str(p) / "task").glob("*/comm") for p in (SP_RANK0, SP_RANK1)}
    saved = {c: c.read_bytes() for cs in comms.values() for c in cs}
    for comm in saved:
        comm.write_bytes(b"python\n")
    now = [SP_STARTED + 3]
    d = Discovery(ProcReader(str(root)), uptime=lambda: now[0])
    assert d.tick() == []
    for comm, data in saved.items():
        if f"/{SP_RANK1}/" in str(comm):
            comm.write_bytes(data)  # rank 1 joined first
    (job,) = d.tick()
    assert {r.label for r in job.ranks.values()} == {"local1"}
    for comm, data in saved.items():
        comm.write_bytes(data)
    (job,) = d.tick()
    assert {pid: r.label for pid, r in job.ranks.items()} == {SP_RANK0: "local0", SP_RANK1: "local1"}


# The capture in fixtures/proc-lightning: a Lightning Fabric job (strategy "ddp", 2 CPU
# devices): rank 0 is the script itself, which re-ran itself with LOCAL_RANK=1; one forked
# worker each.
LT_RANK0, LT_RANK1, LT_WORKER0, LT_WORKER1 = 5714, 5736, 5763, 5762


@pytest.mark.parametrize(
    "argv, parent, expected",
    [
        # Lightning gives the child the script's absolute path and the same arguments
        (("/v/bin/python", "/w/train.py", "--lr", "1"), ("python", "train.py", "--lr", "1"), True),
        (("/v/bin/python", "-m", "pkg.train", "--x"), ("python3", "-m", "pkg.train", "--x"), True),
        (("/v/bin/python", "/w/train.py", "--lr", "2"), ("python", "train.py", "--lr", "1"), False),
        (("/v/bin/python", "/w/eval.py"), ("python", "train.py"), False),
        (("/usr/bin/env", "train.py"), ("python", "train.py"), False),  # not an interpreter
        (("/v/bin/python", "-c", "import x"), ("python", "train.py"), False),
        # a path with a space is a path (a job names what it likes)
        (("/v/bin/python", "/w/my run/t.py", "-x"), ("python", "my run/t.py", "-x"), True),
        (("/v/bin/python", "/w/my run/t.py"), ("python", "run/t.py"), True),
    ],
)
def test_relaunched_forms(argv, parent, expected):
    assert relaunched(argv, parent) == expected


def test_a_lightning_launch_is_a_job_whose_launching_process_is_rank_0(tmp_path):
    """The script re-ran itself with LOCAL_RANK=1 (and NODE_RANK, no RANK): it is a
    Lightning job's launching process and its local rank 0; each rank's tree is its own
    (rank 0's holds its worker, not rank 1 and rank 1's)."""
    root = _copy(tmp_path, "proc-lightning")
    d = Discovery(ProcReader(str(root)))
    (job,) = d.tick()
    assert job.agent.pid == LT_RANK0 and job.launcher == "lightning" and job.key == str(LT_RANK0)
    ranks = {pid: (r.label, r.rank, r.local_rank, r.rank_source) for pid, r in job.ranks.items()}
    # on node 0 (NODE_RANK=0) a Lightning rank's global rank is its local rank
    assert ranks == {LT_RANK0: ("0", 0, 0, "order"), LT_RANK1: ("1", 1, 1, "LOCAL_RANK")}
    assert job.world_size == 2 and job.entrypoint.endswith("tests/workloads/lightning_job.py")
    assert d.tree(LT_RANK0) == [LT_RANK0, LT_WORKER0] and d.tree(LT_RANK1) == [LT_RANK1, LT_WORKER1]


@pytest.mark.parametrize(
    "environ",
    [
        b"LOCAL_RANK=1\0WORLD_SIZE=2\0",  # no NODE_RANK: not Lightning's
        b"LOCAL_RANK=1\0NODE_RANK=0\0RANK=1\0WORLD_SIZE=2\0",  # a RANK: a launcher that gives one
        b"LOCAL_RANK=0\0NODE_RANK=0\0WORLD_SIZE=2\0",  # rank 0's own child (a subprocess, a worker)
    ],
)
def test_a_child_of_the_same_program_without_lightning_s_environment_is_no_job(tmp_path, environ):
    root = _copy(tmp_path, "proc-lightning")
    (root / str(LT_RANK1) / "environ").write_bytes(environ)
    assert Discovery(ProcReader(str(root))).tick() == []


def test_a_lightning_rank_on_another_node_has_no_global_rank(tmp_path):
    """Off node 0 the ranks per node are not in the environment: local ranks only."""
    root = _copy(tmp_path, "proc-lightning")
    for pid in (LT_RANK1, LT_WORKER1):
        environ = root / str(pid) / "environ"
        environ.write_bytes(environ.read_bytes().replace(b"NODE_RANK=0", b"NODE_RANK=3"))
    (job,) = Discovery(ProcReader(str(root))).tick()
    assert {r.label: (r.rank, r.local_rank) for r in job.ranks.values()} == {
        "local0": (None, 0),
        "local1": (None, 1),
    }


def test_a_child_running_another_program_is_no_lightning_rank(tmp_path):
    root = _copy(tmp_path, "proc-lightning")
    (root / str(LT_RANK1) / "cmdline").write_bytes(b"/usr/bin/python3\0other.py\0")
    assert Discovery(ProcReader(str(root))).tick() == []


# The capture in fixtures/proc-mpi: Open MPI 4.1's mpirun -np 2, its two ranks (children of
# mpirun, their MPI identity in their environment) and one forked worker each.
MPI_RUN, MPI_RANK0, MPI_RANK1, MPI_WORKER0, MPI_WORKER1 = 10264, 10272, 10273, 10296, 10295


def test_an_mpirun_launch_is_a_job_its_ranks_numbered_by_their_mpi_rank(tmp_path):
    root = _copy(tmp_path, "proc-mpi")
    d = Discovery(ProcReader(str(root)))
    (job,) = d.tick()
    assert job.agent.pid == MPI_RUN and job.launcher == "mpi"
    assert job.key == job.run_id == "1155923969" and job.world_size == 2  # Open MPI's job id
    ranks = {pid: (r.label, r.local_rank, r.rank_source) for pid, r in job.ranks.items()}
    assert ranks == {MPI_RANK0: ("0", 0, "OMPI_COMM_WORLD_RANK"), MPI_RANK1: ("1", 1, "OMPI_COMM_WORLD_RANK")}
    assert d.tree(MPI_RANK0) == [MPI_RANK0, MPI_WORKER0] and d.tree(MPI_RANK1) == [MPI_RANK1, MPI_WORKER1]


def test_an_mpi_rank_s_rank_is_its_mpi_rank_never_a_rank_variable_it_inherited(tmp_path):
    """MPI never sets RANK: one in a rank's environment came from the shell that ran mpirun."""
    root = _copy(tmp_path, "proc-mpi")
    for pid in (MPI_RANK0, MPI_RANK1):
        environ = root / str(pid) / "environ"
        environ.write_bytes(b"RANK=5\0" + environ.read_bytes())
    (job,) = Discovery(ProcReader(str(root))).tick()
    assert sorted(r.label for r in job.ranks.values()) == ["0", "1"]


def test_a_launcher_run_by_mpirun_is_a_job_of_its_own(tmp_path):
    """``mpirun -np 1 torchrun ...``: mpirun's child is torchrun's agent, whose workers are
    the ranks; it is no rank of mpirun's."""
    root = _copy(tmp_path, "proc-mpi")
    (root / str(MPI_RANK1) / "cmdline").write_bytes(
        b"/v/bin/python\0/v/bin/torchrun\0--nproc-per-node=1\0t.py\0"
    )
    # its "worker" is now a torchrun worker: its environment says so
    (root / str(MPI_WORKER1) / "environ").write_bytes(
        b"TORCHELASTIC_RUN_ID=r1\0RANK=0\0LOCAL_RANK=0\0WORLD_SIZE=1\0"
    )
    d = Discovery(ProcReader(str(root)))
    by_agent = {j.agent.pid: j for j in d.tick()}
    assert set(by_agent) == {MPI_RUN, MPI_RANK1}
    assert by_agent[MPI_RANK1].launcher == "torchrun" and set(by_agent[MPI_RANK1].ranks) == {MPI_WORKER1}
    assert set(by_agent[MPI_RUN].ranks) == {MPI_RANK0}


# The capture in fixtures/proc-slurm: a step of a real single-node Slurm (`srun -n2
# --mem=1536M python tests/workloads/task_job.py`): its slurmstepd, the two tasks and one
# forked worker each.
SL_STEPD, SL_RANK0, SL_RANK1, SL_WORKER0, SL_WORKER1 = 13527, 13532, 13533, 13619, 13618


def test_a_slurm_step_is_a_job_keyed_by_its_job_and_step(tmp_path):
    root = _copy(tmp_path, "proc-slurm")
    d = Discovery(ProcReader(str(root)))
    (job,) = d.tick()
    assert job.agent.pid == SL_STEPD and job.launcher == "slurm" and job.key == "2.0" and job.world_size == 2
    ranks = {pid: (r.label, r.local_rank, r.rank_source) for pid, r in job.ranks.items()}
    assert ranks == {SL_RANK0: ("0", 0, "SLURM_PROCID"), SL_RANK1: ("1", 1, "SLURM_PROCID")}
    assert d.tree(SL_RANK0) == [SL_RANK0, SL_WORKER0] and d.tree(SL_RANK1) == [SL_RANK1, SL_WORKER1]


def test_a_batch_script_is_no_rank_of_its_step(tmp_path):
    """The batch step's script has SLURM_PROCID but no step id: it is no task of a step."""
    root = _copy(tmp_path, "proc-slurm")
    (root / str(SL_STEPD) / "cmdline").write_bytes(b"slurmstepd: [2.batch]\0")
    for pid in (SL_RANK0, SL_RANK1):
        environ = root / str(pid) / "environ"
        environ.write_bytes(environ.read_bytes().replace(b"SLURM_STEP_ID=0\0", b""))
    (job,) = Discovery(ProcReader(str(root))).tick()
    assert job.launcher == "slurm" and job.ranks == {}


def test_torchrun_started_by_srun_is_a_job_of_its_own(tmp_path):
    """``srun torchrun ...``: the task is torchrun's agent, whose workers are the ranks."""
    root = _copy(tmp_path, "proc-slurm")
    (root / str(SL_RANK1) / "cmdline").write_bytes(
        b"/v/bin/python\0/v/bin/torchrun\0--nproc-per-node=1\0t.py\0"
    )
    (root / str(SL_WORKER1) / "environ").write_bytes(
        b"TORCHELASTIC_RUN_ID=r9\0RANK=1\0LOCAL_RANK=0\0WORLD_SIZE=2\0"
    )
    by_agent = {j.agent.pid: j for j in Discovery(ProcReader(str(root))).tick()}
    assert by_agent[SL_RANK1].launcher == "torchrun" and set(by_agent[SL_RANK1].ranks) == {SL_WORKER1}
    assert set(by_agent[SL_STEPD].ranks) == {SL_RANK0}
