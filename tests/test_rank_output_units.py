"""The ranks' own words: parsers on real text (a gloo timeout captured here, the NCCL
watchdog captured on the H200 machine, the public logs) and the verdicts they give."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sidecar.autopsy import Evidence, KernelOom, RankState, autopsy
from sidecar.parse.ranks import Finding, parse_rank_output
from tests.paths import CAPTURES, PUBLIC_CASES

HERE = Path(__file__).resolve().parent
GLOO = HERE / "fixtures" / "rank-output" / "gloo-timeout-torch2.13.log"
S = 10**9


def _kinds(findings: list[Finding]) -> list[tuple[str, int | None]]:
    return [(f.kind, f.rank) for f in findings]


def test_gloo_timeout_captured_here():
    """torch 2.13, gloo on CPU: rank 1 stopped joining; rank 0's all_reduce timed out."""
    found = parse_rank_output(GLOO.read_text())
    assert _kinds(found) == [("exception", 0), ("gloo_timeout", 0)]
    exc, timeout = found
    assert exc.get("type") == "RuntimeError" and exc.get("collective") == "all_reduce"
    assert timeout.get("timeout_ms") == "5000" and timeout.get("op") == "recv"


def test_nccl_watchdog_captured_on_the_h200():
    capture = json.loads((CAPTURES / "torchrun-D.json").read_text())
    text = "\n".join(re.sub(r"^\d+\.\d+ ", "", line) for line in capture["agent_output"])
    found = parse_rank_output(text)
    timeout = next(f for f in found if f.kind == "nccl_timeout")
    assert timeout.rank == 0
    assert dict(timeout.fields) == {
        "seq": "2",
        "op": "ALLREDUCE",
        "timeout_ms": "5000",
        "ran_ms": "5049",
        "numel_in": "1048576",
        "numel_out": "1048576",
    }
    progress = next(f for f in found if f.kind == "nccl_progress")
    assert (progress.get("last_enqueued"), progress.get("last_completed")) == ("2", "1")


def test_public_rank_stderr_of_every_generation():
    cases = {c["id"]: c for c in map(json.loads, PUBLIC_CASES.read_text().splitlines())}

    def found(case_id: str) -> list[Finding]:
        text = "\n".join(e["text"] for e in cases[case_id]["evidence"] if e["kind"] == "rank_stderr")
        return parse_rank_output(text)

    old = [f for f in found("ofa-271-allreduce-30min-v100") if f.kind == "nccl_timeout"]  # 1.x, no Numel
    assert [f.rank for f in old] == [1, 3, 2, 6, 7]
    assert {f.get("seq") for f in old} == {"469508"} and old[0].get("timeout_ms") == "1800000"
    pid_prefixed = found("llamafactory-7396-allreduce-10min")  # "[80746] [rank0]:[E321 ...]"
    assert [(f.kind, f.rank) for f in pid_prefixed if f.kind == "nccl_timeout"] == [
        ("nccl_timeout", 0),
        ("nccl_timeout", 4),
    ]
    assert [f.rank for f in pid_prefixed if f.kind == "nccl_progress"] == [0, 3]
    allgather = found("arctictraining-219-allgather-plus-heartbeat")
    assert ("nccl_heartbeat", 7) in _kinds(allgather)
    assert next(f for f in allgather if f.kind == "nccl_timeout").get("op") == "_ALLGATHER_BASE"
    assert _kinds(found("llamafactory-8549-streaming-hang-heartbeat")) == [("nccl_heartbeat", 2)]
    assert [f.kind for f in found("simplerecon-3-shm-limit")] == ["shm_bus_error"]
    assert [f.kind for f in found("returnn-1482-cuda-oom-abort")] == [
        "cuda_oom"
    ]  # "CUDA error: out of memory"


def test_cuda_oom_old_and_new_wording_and_dataloader_lines():
    old = (
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; "
        "75.01 GiB already allocated; 1.20 GiB free; 76.50 GiB reserved in total by PyTorch)"
    )
    new = (
        "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 3 has a total "
        "capacity of 79.10 GiB of which 5.00 GiB is free. Including non-PyTorch memory, this process has "
        "74.09 GiB memory in use."
    )
    a, b = parse_rank_output(old + "\n" + new)
    assert (a.kind, a.get("requested_bytes"), a.get("gpu"), a.get("total_bytes")) == (
        "cuda_oom",
        str(2 << 30),
        "0",
        str(int(79.15 * 2**30)),
    )
    assert (b.rank, b.get("requested_bytes"), b.get("gpu"), b.get("free_bytes")) == (
        3,
        str(20 << 30),
        "3",
        str(5 << 30),
    )
    dl = parse_rank_output(
        "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that "
        "dataloader's workers are out of shared memory.\n"
        "RuntimeError: DataLoader worker (pid(s) 12, 13) exited unexpectedly"
    )
    assert [(f.kind, f.get("pids"), f.get("signal")) for f in dl] == [
        ("dataloader_killed", "4242", "Bus error"),
        ("dataloader_killed", "12, 13", None),
    ]


def test_interleaved_tracebacks_stay_apart_and_tee_prefixes_give_the_local_rank():
    text = "\n".join(
        [
            "[default0]:Traceback (most recent call last):",
            "[default1]:Traceback (most recent call last):",
            '[default0]:  File "train.py", line 3, in <module>',
            '[default1]:  File "/x/torch/distributed/distributed_c10d.py", line 3252, in broadcast',
            "[default1]:    work.wait()",
            "[default0]:KeyError: 'labels'",
            "[default1]:RuntimeError: Connection closed by peer",
        ]
    )
    found = parse_rank_output(text)
    assert [(f.local_rank, f.get("type"), f.get("collective")) for f in found] == [
        (0, "KeyError", None),
        (1, "RuntimeError", "broadcast"),
    ]


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


DEVICE = HERE / "fixtures" / "device-h200"


def test_real_nccl_timeout_and_cuda_oom_from_the_h200_under_trainwatch_run():
    """benchmarks/gpu_failures.sh on the H200 (torch 2.11, one rank each): the output that
    `trainwatch run` passed through, and what the postmortems said."""
    nccl = parse_rank_output((DEVICE / "nccl-timeout.stderr").read_text())
    timeout = next(f for f in nccl if f.kind == "nccl_timeout")
    assert (timeout.rank, timeout.get("seq"), timeout.get("op"), timeout.get("timeout_ms")) == (
        0,
        "2",
        "ALLREDUCE",
        "5000",
    )
    said = (DEVICE / "nccl-timeout.postmortem.txt").read_text()
    assert "killer: collective_timeout (certain)" in said and "NCCL allreduce (SeqNum 2)" in said
    oom = [f for f in parse_rank_output((DEVICE / "cuda-oom.stderr").read_text()) if f.kind == "cuda_oom"]
    assert len(oom) == 1 and oom[0].rank is None  # no process group: torch adds no [rank0]: prefix
    assert oom[0].get("requested_bytes") == str(int(139.80 * 2**30))
    assert oom[0].get("free_bytes") == str(int(131.20 * 2**30)) and oom[0].get("gpu") == "0"
    # the verdict that run should have given: a world of one, so the unprefixed lines are its own
    lone = _rank("0", 2637, 1 << 8, S)
    exc = next(
        f for f in parse_rank_output((DEVICE / "cuda-oom.stderr").read_text()) if f.kind == "exception"
    )
    v = autopsy(Evidence((lone,), output=((None, exc), (None, oom[0])), world_size=1))
    assert v is not None and (v.kind, v.confidence) == ("cuda_oom", "certain"), v
    assert "tried to allocate 139.80 GiB of 139.8 GiB, 131.20 GiB free" in v.summary
    # two ranks, the other still running: the unprefixed lines are likely the victim's, not certain
    v = autopsy(Evidence((lone, _rank("1", 2638, None, None)), output=((None, oom[0]),), world_size=2))
    assert v is not None and (v.kind, v.confidence) == ("cuda_oom", "likely")
    # two ranks that both failed by themselves: whose lines these are cannot be told
    both = (lone, _rank("1", 2638, 1 << 8, S + 1))
    v = autopsy(Evidence(both, output=((None, oom[0]),), world_size=2))
    assert v is not None and (v.kind, v.confidence) == ("python_exception", "possible")
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
    v = autopsy(Evidence((_rank("1", 11, 1 << 8, S),), output=(("1", found),), shm=(1 << 20, 1 << 20)))
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


def test_each_line_carries_its_own_time():
    """glog stamps (torch's C++ and 2.4+ Python logs) have no year and are local time; the
    Python-logging and 2.1-2.3 agent stamps do; torch 1.x and gloo lines have none."""
    import time

    from sidecar.parse.ranks import line_stamp, stamp_to_epoch

    nccl = parse_rank_output((DEVICE / "nccl-timeout.stderr").read_text())
    timeout = next(f for f in nccl if f.kind == "nccl_timeout")
    near = time.mktime((2026, 12, 2, 21, 44, 22, 0, 0, -1))  # the death, 38 s later (heartbeat monitor)
    assert timeout.stamp == (None, 12, 2, 21, 43, 44, 289164)
    assert stamp_to_epoch(timeout.stamp, near) == pytest.approx(near - 38 + 0.289164, abs=1e-3)
    # a December stamp read on the 1st of January belongs to the year before
    new_year = time.mktime((2027, 1, 1, 0, 0, 5, 0, 0, -1))
    assert stamp_to_epoch((None, 12, 31, 23, 59, 58, 0), new_year) == pytest.approx(new_year - 7)
    # a time days away from the death is another run's, or another zone's: not used
    assert stamp_to_epoch((2024, 1, 1, 12, 0, 0, 123000), near) is None
    assert line_stamp("2026-12-02 18:24:01,331 WARNING sidecar.deaths: x") == (2026, 12, 2, 18, 24, 1, 331000)
    assert line_stamp("[2024-01-01 12:00:00,123] torch.distributed.elastic") == (2024, 1, 1, 12, 0, 0, 123000)
    assert line_stamp("[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught") is None
    assert line_stamp("E1399 18:00:00.1 bogus") is None
    assert all(f.stamp is None for f in parse_rank_output(GLOO.read_text()))


def test_the_real_flight_recorder_dump_of_the_h200():
    """The dump torch 2.11 wrote on the H200 when its all_reduce #2 timed out (a world of
    one, the collective queued behind a long kernel), and the postmortem made of it."""
    from dataclasses import replace

    from sidecar.parse.flight import parse_dump, summarise

    path = DEVICE / "nccl_trace_rank_0"
    dump = parse_dump(path.read_bytes(), 0, str(path))
    assert dump.status == {"default_pg": (2, -1, 1)}
    assert dump.entries["default_pg"][2][:2] == ("all_reduce", "scheduled")
    fr = summarise([dump], (0,))
    assert fr is not None and (fr.seq, fr.op, fr.laggards) == (2, "all_reduce", ())
    # that rank alone of a world of two: the other wrote no dump, so it is the one missing
    two = summarise([dump], (0, 1))
    assert two is not None and two.laggards == (1,)
    doc = json.loads((DEVICE / "nccl-timeout.postmortem.json").read_text())
    assert doc["killer"]["kind"] == "collective_timeout" and "whole world" in doc["killer"]["summary"]
    cited = {e["source"] for e in doc["killer"]["evidence"]}
    assert {"exit", "output", "flight_recorder"} <= cited
    assert all(e["at"] for e in doc["killer"]["evidence"] if e["source"] == "output")  # each line's own time
    # the verdict again from the fixture, with the dump
    nccl = [("0", f) for f in parse_rank_output((DEVICE / "nccl-timeout.stderr").read_text())]
    ranks = (_rank("0", 510, 6, S),)
    v = autopsy(Evidence(ranks, output=tuple(nccl), world_size=1, flight=fr, flight_enabled=True))
    assert v is not None and "it is the whole world" in v.summary, v.summary
    assert any(e.source == "flight_recorder" and "waiting in #2" in e.detail for e in v.evidence)
    # two ranks whose dumps both say "waiting in #2": every rank entered it
    both = summarise([dump, replace(dump, rank=1)], (0, 1))
    ranks = (*ranks, _rank("1", 511, 6, S + 1))
    v = autopsy(Evidence(ranks, output=tuple(nccl), world_size=2, flight=both, flight_enabled=True))
    assert v is not None and "every rank entered it (flight recorder)" in v.summary, v.summary
