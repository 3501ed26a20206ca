"""The verdicts the dead rank's own words and the GPU give (autopsy/said.py): timeouts of
every backend, CUDA OOMs, exceptions, /dev/shm bus errors, NVRM Xids, on real output
(a gloo timeout captured here, the NCCL timeout and CUDA OOM captured on the H200)."""

from __future__ import annotations

import json

from sidecar.autopsy import Evidence, KernelOom, RankState, autopsy
from sidecar.parse.ranks import Finding, parse_rank_output
from tests.support.paths import DEVICE_H200, PUBLIC_CASES

S = 10**9


def _rank(label: str, pid: int, code: int | None, died: int | None) -> RankState:
    return RankState(label, int(label), int(label), pid, (), code, died, "/job", None, "connector")


def test_output_verdicts():
    timed_out = Finding("gloo_timeout", 0, None, "Timed out waiting 5000ms", (("timeout_ms", "5000"),))
    exc = Finding(
        "exception", 0, None, "RuntimeError: ...", (("type", "RuntimeError"), ("collective", "all_reduce"))
    )
    r0, r1 = _rank("0", 10, 1 << 8, 10 * S), _rank("1", 11, 15, 10 * S + 10**8)
    v = autopsy(Evidence((r0, r1), output=(("0", exc), ("0", timed_out)), output_read=True))
    assert v is not None and (v.kind, v.confidence) == ("collective_timeout", "certain")
    assert "gloo all_reduce did not complete within 5 s; rank 1 never arrived" in v.summary
    assert v.fates == {"0": "root_cause", "1": "terminated_by_agent"}
    # every rank timed out: none here is "the one that never arrived"
    both = (("0", timed_out), ("1", Finding("gloo_timeout", 1, None, "Timed out", (("timeout_ms", "5000"),))))
    v = autopsy(Evidence((r0, _rank("1", 11, 1 << 8, 10 * S + 5)), output=both))
    assert v is not None and "every rank here was waiting" in v.summary and v.fates["1"] == "same_cause"
    # a rank killed first by an OOM stays the root cause; its peer's timeout is the cascade
    killed = _rank("1", 11, 9, 9 * S)
    oom = KernelOom(
        11,
        9 * S,
        "memcg",
        "/job",
        "/job",
        "python",
        1 << 30,
        ("Memory cgroup out of memory: Killed process 11",),
    )
    v = autopsy(Evidence((r0, killed), kernel=(oom,), output=(("0", timed_out),)))
    assert v is not None and v.kind == "cgroup_oom" and v.victim.pid == 11
    assert v.fates["0"] == "same_cause"
    assert any(e.source == "output" and e.detail.startswith("then rank 0:") for e in v.evidence)
    # the exception line, the CUDA OOM, the shm bus error
    raised = Finding("exception", 1, None, "ValueError: bad batch", (("type", "ValueError"),))
    v = autopsy(Evidence((_rank("1", 11, 1 << 8, S),), output=(("1", raised),)))
    assert v is not None and (v.kind, v.confidence, v.summary) == (
        "python_exception",
        "certain",
        "rank 1 (pid 11) raised ValueError: bad batch",
    )
    cuda = Finding(
        "cuda_oom", 1, None, "CUDA out of memory", (("requested_bytes", str(2 << 30)), ("gpu", "0"))
    )
    v = autopsy(Evidence((_rank("1", 11, 1 << 8, S),), output=(("1", cuda),)))
    assert v is not None and v.kind == "cuda_oom" and "tried to allocate 2.00 GiB" in v.summary
    shm = Finding("shm_bus_error", None, None, "ERROR: Unexpected bus error encountered in worker.")
    v = autopsy(Evidence((_rank("1", 11, 1 << 8, S),), output=(("1", shm),)))
    assert v is not None and v.kind == "bus_error" and "/dev/shm" in v.summary
    # another rank's words never explain this one's death; nothing read: say so
    v = autopsy(Evidence((_rank("1", 11, 1 << 8, S),), output=(("0", raised),)))
    assert v is not None and (v.kind, v.confidence) == ("python_exception", "possible")
    assert "its output was not read" in v.summary


def test_real_nccl_timeout_and_cuda_oom_from_the_h200_under_trainwatch_run():
    """benchmarks/gpu_failures.sh on the H200 (torch 2.11, one rank each): the output that
    `trainwatch run` passed through, and what the postmortems said."""
    nccl = parse_rank_output((DEVICE_H200 / "nccl-timeout.stderr").read_text())
    timeout = next(f for f in nccl if f.kind == "nccl_timeout")
    assert (timeout.rank, timeout.get("seq"), timeout.get("op"), timeout.get("timeout_ms")) == (
        0,
        "2",
        "ALLREDUCE",
        "5000",
    )
    said = (DEVICE_H200 / "nccl-timeout.postmortem.txt").read_text()
    assert "killer: collective_timeout (certain)" in said and "NCCL allreduce (SeqNum 2)" in said
    oom = [
        f for f in parse_rank_output((DEVICE_H200 / "cuda-oom.stderr").read_text()) if f.kind == "cuda_oom"
    ]
    assert len(oom) == 1 and oom[0].rank is None  # no process group: torch adds no [rank0]: prefix
    assert oom[0].get("requested_bytes") == str(int(139.80 * 2**30))
    assert oom[0].get("free_bytes") == str(int(131.20 * 2**30)) and oom[0].get("gpu") == "0"
    # the verdict that run should have given: a world of one, so the unprefixed lines are its own
    lone = _rank("0", 2637, 1 << 8, S)
    exc = next(
        f for f in parse_rank_output((DEVICE_H200 / "cuda-oom.stderr").read_text()) if f.kind == "exception"
    )
    v = autopsy(Evidence((lone,), output=((None, exc), (None, oom[0])), world_size=1))
    assert v is not None and (v.kind, v.confidence) == ("cuda_oom", "certain"), v
    assert "tried to allocate 139.80 GiB of 139.8 GiB, 131.20 GiB free" in v.summary
    # two ranks, the other still running: the unprefixed lines are likely the victim's, not certain
    v = autopsy(Evidence((lone, _rank("1", 2638, None, None)), output=((None, oom[0]),), world_size=2))
    assert v is not None and (v.kind, v.confidence) == ("cuda_oom", "likely")
    # two ranks that both failed by themselves with one status, no line naming a rank:
    # the words are one of theirs, which one cannot be told
    both = (lone, _rank("1", 2638, 1 << 8, S + 1))
    v = autopsy(Evidence(both, output=((None, oom[0]),), world_size=2))
    assert v is not None and (v.kind, v.confidence) == ("cuda_oom", "possible"), v
    assert v.summary.startswith("One of the 2 ranks that exited with status 1 (no line says which)"), (
        v.summary
    )
    # ... but when a line names a rank, the unnamed ones are nobody's in particular
    named = next(f for f in nccl if f.kind == "nccl_timeout" and f.rank is not None)
    v = autopsy(Evidence(both, output=((None, oom[0]), ("1", named)), world_size=2))
    assert v is not None and v.kind != "cuda_oom", v
    # ... and so when the two ended differently (one by a signal)
    v = autopsy(Evidence((lone, _rank("1", 2638, 9, S + 1)), output=((None, oom[0]),), world_size=2))
    assert v is not None and (v.kind, v.confidence) != ("cuda_oom", "possible"), v
    # a world of one whose all_reduce waited on its own GPU work
    nccl_only = next(f for f in nccl if f.kind == "nccl_timeout")
    v = autopsy(Evidence((_rank("0", 511, 6, S),), output=(("0", nccl_only),), world_size=1))
    assert v is not None and v.kind == "collective_timeout" and "it is the whole world" in v.summary


def test_shm_full_is_named_and_a_self_raised_fault_is_certain():
    from sidecar.autopsy import SignalSent

    # torch 2.13 preallocates shared memory: a full /dev/shm is an exception, not a SIGBUS
    line = (
        "[rank1]: RuntimeError: unable to allocate shared memory(shm) for file </torch_15832_3955712927_0>: "
        "No space left on device (28)"
    )
    (found,) = [f for f in parse_rank_output(line) if f.kind == "shm_full"]
    v = autopsy(Evidence((_rank("1", 11, 1 << 8, S),), output=(("1", found),), shm=(1 << 20, 1 << 20, None)))
    assert (
        v is not None
        and v.kind == "python_exception"
        and "/dev/shm ran out (1.0 MiB used of 1.0 MiB)" in v.summary
    )
    # SIGSEGV that the kernel raised for the rank's own fault (si_code SEGV_MAPERR = 1)
    segv = _rank("1", 11, 11, S)
    self_sent = SignalSent("python", 11, 11, 11, 1, S - 1000)
    v = autopsy(Evidence((segv,), signals=(self_sent,)))
    assert v is not None and (v.kind, v.confidence) == ("segfault", "certain")
    # the same signal sent by someone else is an outside kill, said so
    v = autopsy(Evidence((segv,), signals=(SignalSent("bash", 99, 11, 11, 0, S - 1000),)))
    assert v is not None and v.kind == "external_signal" and "pid 99 (bash)" in v.summary


def test_an_nvrm_xid_names_a_gpu_error():
    from sidecar.parse.kernel import parse_xid_line

    cases = {c["id"]: c for c in map(json.loads, PUBLIC_CASES.read_text().splitlines())}
    text = cases["nvidia-docker-1553-xid79-fallen-off-bus"]["evidence"][0]["text"]
    xids = [x for x in map(parse_xid_line, text.splitlines()) if x is not None]
    assert [(x.bus, x.xid, x.pid, x.detail) for x in xids] == [
        ("0000:09:00", 79, None, "GPU has fallen off the bus.")
    ]
    named = parse_xid_line(
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics Exception: ESR 0x50"
    )
    assert named is not None and (named.xid, named.pid, named.process) == (13, 4242, "python")
    victim = _rank("1", 4242, 6, 10 * S)
    v = autopsy(Evidence((victim,), xids=((10 * S - 10**9, xids[0]),)))
    assert v is not None and (v.kind, v.confidence) == ("gpu_error", "likely") and "Xid 79" in v.summary
    v = autopsy(Evidence((victim,), xids=((10 * S, named),)))
    assert v is not None and (v.kind, v.confidence) == ("gpu_error", "certain")
    # an Xid that is usually the program's own bug, naming another process: not this death's cause
    other = parse_xid_line("NVRM: Xid (PCI:0000:3b:00): 13, pid=99, name=python, Graphics Exception")
    v = autopsy(Evidence((victim,), xids=((10 * S, other),)))  # type: ignore[arg-type]
    assert v is not None and v.kind == "abort"


def _caught_line(message, pid: str) -> str:
    from tests.support.catalog_formats import placeholders, render

    fixed = {
        "uint": "7",
        "int": "7",
        "hex": "0x18",
        "word": "main",
        "name": "node1",
        "path": "/usr/lib/libx.so",
    }
    values = {name: fixed.get(typ, "some text") for name, typ in placeholders(message.format)}
    if "pid" in values:
        values["pid"] = pid
    return render(message.format, values)


def test_a_process_dies_of_the_first_fatal_signal_it_caught():
    """Generated from the catalog's ``caught`` banners (a handler's report, from inside the
    process, of the fatal signal it caught): of two in one process's output, of different
    signals, the first decides whichever order their kinds would rank in (a handler that
    crashes while an abort unwinds reports a SIGSEGV it did not die of); of two processes
    (two pids), each its own."""
    from sidecar.catalog import catalog

    caught = [m for m in catalog().messages if m.caught and m.kind is not None]
    assert {m.kind.value for m in caught} >= {"segfault", "bus_error", "abort"}
    pairs = [(a, b) for a in caught for b in caught if a.kind != b.kind]
    assert pairs
    for a, b in pairs:
        text = _caught_line(a, "4242") + "\n" + _caught_line(b, "4242")
        said = [f for f in parse_rank_output(text) if f.kind == "said"]
        v = autopsy(
            Evidence((_rank("0", 4242, None, S),), output=tuple(("0", f) for f in said), output_read=True)
        )
        assert v is not None and v.kind == a.kind.value, (a.id, b.id, v.kind if v else None)
    # a later banner of another process is no part of the first one's death
    ompi_abort, ucx_segv = (
        catalog().by_id["mpi.ompi_signal_abort"],
        catalog().by_id["mpi.ucx_caught_signal_segv"],
    )
    text = _caught_line(ompi_abort, "4242") + "\n" + _caught_line(ucx_segv, "4343")
    said = [f for f in parse_rank_output(text) if f.kind == "said"]
    v = autopsy(
        Evidence((_rank("0", 4343, None, S),), output=tuple(("0", f) for f in said), output_read=True)
    )
    assert v is not None and v.kind == "segfault"  # any kind before an abort, as ever
