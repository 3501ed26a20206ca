"""The ranks' own words, parsed: a gloo timeout captured here, the NCCL watchdog captured on
the H200 machine, every generation's rank stderr in the public logs, CUDA OOMs, interleaved
tracebacks, and each line's own time."""

from __future__ import annotations

import json
import re

import pytest

from sidecar.parse.ranks import Finding, parse_rank_output
from tests.support.paths import CAPTURES, DEVICE_H200, PUBLIC_CASES, RANK_OUTPUT

GLOO = RANK_OUTPUT / "gloo-timeout-torch2.13.log"


def _kinds(findings: list[Finding]) -> list[tuple[str, int | None]]:
    """The structured findings (the catalog's "said" findings are tested on their own)."""
    return [(f.kind, f.rank) for f in findings if f.kind != "said"]


def _structured(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.kind != "said"]


def test_gloo_timeout_captured_here():
    """torch 2.13, gloo on CPU: rank 1 stopped joining; rank 0's all_reduce timed out."""
    found = parse_rank_output(GLOO.read_text())
    assert _kinds(found) == [("exception", 0), ("gloo_timeout", 0)]
    exc, timeout = _structured(found)
    # the catalog reads the same two lines: the exception (generic) and gloo's timeout
    assert {f.get("id") for f in found if f.kind == "said"} == {
        "python.exception_last_line",
        "c10d.gloo_recv_timeout",
    }
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
    shm = found("simplerecon-3-shm-limit")
    assert [f.kind for f in shm if f.kind != "said"] == ["shm_bus_error"]
    # the same line is the catalog's DataLoader message too
    assert [f.get("id") for f in shm if f.kind == "said"] == ["python.worker_bus_error"]
    assert [f.kind for f in found("returnn-1482-cuda-oom-abort") if f.kind != "said"] == [
        "cuda_oom"
    ]  # "CUDA error: out of memory"


def test_the_allocator_s_message_cut_after_its_head_is_still_its_own():
    """A paste (or a logger) that kept only the first sentence of the caching allocator's
    message: the exception's words are the allocator's, whatever torch named the type."""
    for line in (
        "torch.cuda.OutOfMemoryError: CUDA out of memory.",
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate",
        "RuntimeError: CUDA out of memory",
    ):
        assert [f.kind for f in parse_rank_output(line) if f.kind != "said"] == ["cuda_oom"], line
    for line in (  # someone's words about it, or a later sentence: not the allocator's message
        "I keep getting CUDA out of memory.",
        "WARNING: ran out of memory with exception: CUDA out of memory; skipping batch",
        "RuntimeError: CUDA out of memory. Try a smaller batch size",
    ):
        assert [f for f in parse_rank_output(line) if f.kind == "cuda_oom"] == [], line


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
    a, b = _structured(parse_rank_output(old + "\n" + new))
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
    assert [(f.kind, f.get("pids"), f.get("signal")) for f in _structured(dl)] == [
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
    assert [(f.local_rank, f.get("type"), f.get("collective")) for f in found if f.kind == "exception"] == [
        (0, "KeyError", None),
        (1, "RuntimeError", "broadcast"),
    ]
    # the catalog reads the same last lines: each rank's own, as a symptom
    assert {(f.local_rank, f.get("id")) for f in found if f.kind == "said"} == {
        (0, "python.exception_last_line"),
        (1, "python.exception_last_line"),
    }


def test_each_line_carries_its_own_time():
    """glog stamps (torch's C++ and 2.4+ Python logs) have no year and are local time; the
    Python-logging and 2.1-2.3 agent stamps do; torch 1.x and gloo lines have none."""
    import time

    from sidecar.parse.ranks import line_stamp, stamp_to_epoch

    nccl = parse_rank_output((DEVICE_H200 / "nccl-timeout.stderr").read_text())
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


@pytest.mark.parametrize(
    "line, peer",
    [
        # gloo's Pair::read and Pair::write (gloo/transport/tcp/pair.cc) when the peer died:
        # its socket closed, or reset or broken under a read or a write
        ("[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] "
         "Connection closed by peer [18.25.6.30]:30872", "18.25.6.30:30872"),
        ("[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
         "Read error [127.0.0.1]:15776: Connection reset by peer. This is typically caused by a remote",
         "127.0.0.1:15776"),
        ("[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:400] "
         "writev [10.0.0.1]:123: Broken pipe", "10.0.0.1:123"),
        # a timeout or another errno is the network's, not a peer's death
        ("[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error "
         "[192.168.70.92]:25266: Connection timed out", None),
    ],
)  # fmt: skip
def test_a_gloo_peer_that_went_away_is_told_by_every_word_gloo_has_for_it(line, peer):
    found = [f for f in parse_rank_output(line + "\n") if f.kind == "peer_closed"]
    assert [dict(f.fields)["peer"] for f in found] == ([peer] if peer else [])
