"""The message families the catalog learnt in the fourth wave, by what a paste of their own
words must yield (each entry's pattern is tested on its format and its real log in
tests/unit/catalog/test_entries.py): the verdict, its confidence, and the words that must decide nothing."""

from __future__ import annotations

import re

import pytest

from sidecar.catalog import catalog
from sidecar.diagnose import LogInput, diagnose
from tests.support.agent_text import Failure, failure_table


def _killer(text: str) -> tuple[str, str]:
    k = diagnose([LogInput("paste", text)])["killer"]
    return k["kind"], k["confidence"]


_TF = "tensorflow/stream_executor/cuda/cuda_driver.cc"
_TMS = "[torch_memory_saver.cpp]"


_NUMBA = "numba.cuda.cudadrv.driver.CudaAPIError: "
_TB = 'Traceback (most recent call last):\n  File "train.py", line 10, in <module>\n    run()\n'
GPU_ALLOCATORS = [
    # programs that call the driver themselves: KeOps 2.x and NVIDIA's CUDA_SAFE_CALL sample
    (
        "\n[KeOps] error: cuMemAlloc(&p_data, sizeof(TYPE *) * nargs) failed with error "
        "CUDA_ERROR_OUT_OF_MEMORY\n\n" + _TB + "RuntimeError: [KeOps] Cuda error.\n",
        "cuda_oom",
        "certain",
    ),
    (
        "\nerror: cuMemAlloc(&dX, bufferSize) failed with error CUDA_ERROR_OUT_OF_MEMORY\n",
        "cuda_oom",
        "certain",
    ),
    # Numba's CudaAPIError (ctypes, and NVIDIA's bindings' two enum forms), device memory only
    (
        _TB + _NUMBA + "[2] Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY\n",
        "cuda_oom",
        "likely",
    ),
    (
        _TB + _NUMBA + "[<CUresult.CUDA_ERROR_OUT_OF_MEMORY: 2>] Call to cuMemAlloc "
        "results in CUDA_ERROR_OUT_OF_MEMORY\n",
        "cuda_oom",
        "likely",
    ),
    (
        _TB + _NUMBA + "[2] Call to cuMemHostAlloc results in CUDA_ERROR_OUT_OF_MEMORY\n",
        "python_exception",
        "possible",
    ),
    # PyCUDA: device memory (and its pool) is the GPU's; page-locked host memory is not
    (_TB + "pycuda._driver.MemoryError: cuMemAlloc failed: out of memory\n", "cuda_oom", "certain"),
    (
        _TB
        + "pycuda._driver.MemoryError: memory_pool::allocate failed: out of memory - failed to free memory "
        "for allocation\n",
        "cuda_oom",
        "certain",
    ),
    (
        _TB + "pycuda._driver.MemoryError: cuMemHostAlloc failed: out of memory\n",
        "python_exception",
        "likely",
    ),
    # TensorFlow: the fatal ResourceExhaustedError of a GPU's allocator
    (
        _TB
        + "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with "
        "shape[64,3,224,224] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator "
        "GPU_0_bfc\n",
        "cuda_oom",
        "likely",
    ),
    # the runtime's own word about its allocation: the GPU is full
    ("RuntimeError: CUDA error: out of memory\n", "cuda_oom", "certain"),
    # torch's driver-API check under expandable segments: a mapping refused, often with
    # memory free (Jetson, WSL2, virtual GPUs)
    ("RuntimeError: CUDA driver error: out of memory\n", "cuda_oom", "likely"),
    # torch_memory_saver: the retry alone is no death; its exit after it is
    (
        "[torch_memory_saver.cpp] cuMemCreate CUDA_ERROR_OUT_OF_MEMORY (may not be an issue e.g. torch "
        "allocator will free cache and retry)\n",
        "unknown",
        "possible",
    ),
    (
        f"{_TMS} cudaError error: 2 (out of memory)  file=csrc/core.cpp func=resume line=172\n",
        "cuda_oom",
        "likely",
    ),
    (
        f"{_TMS} CUresult error  result=2 file=csrc/torch_memory_saver.cpp func=cu_mem_create line=103\n",
        "cuda_oom",
        "likely",
    ),
    (
        "RuntimeError: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62\n",
        "cuda_oom",
        "likely",
    ),
    (
        "torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory. (out of memory)\n",
        "cuda_oom",
        "certain",
    ),
    (
        "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 25,600,000 bytes (allocated so far: "
        "3,635,267,072 bytes).\n",
        "cuda_oom",
        "likely",
    ),
    # pinned host memory, not the GPU's; an allocator's retry ladder: neither decides
    (
        f"E external/org_tensorflow/{_TF}:802] failed to alloc 782758144 bytes on host: "
        "CUDA_ERROR_OUT_OF_MEMORY: out of memory\n",
        "unknown",
        "possible",
    ),
    (
        f"I {_TF}:789] failed to allocate 3.81G (4087755776 bytes) from device: "
        "CUDA_ERROR_OUT_OF_MEMORY: out of memory\n",
        "unknown",
        "possible",
    ),
]


ALLOCATORS = [
    # heap misuse caught by the allocator, which ends the process
    ("src/tcmalloc.cc:284] Attempt to free invalid pointer 0x13d801860 \n", "abort", "certain"),
    (
        "<jemalloc>: size mismatch detected (true size 0 vs input size 0), likely caused by application "
        "sized deallocation bugs (source address: 0x7fffe6413810, the current pointer being freed). "
        "Suggest building with --enable-debug or address sanitizer for debugging. Abort.\n",
        "abort",
        "certain",
    ),
    ("free(): chunks in smallbin corrupted\nAborted (core dumped)\n", "abort", "certain"),
    ("mremap_chunk(): invalid pointer\nAborted (core dumped)\n", "abort", "certain"),
    # a host allocation failure the allocator turns into an abort: not a kernel OOM kill
    ("<jemalloc>: Error in malloc(): out of memory\n Requested: 56\n", "abort", "certain"),
    # reports that end nothing: a large allocation that succeeded, a failed span, mimalloc's
    # errors it ignores by default
    ("tcmalloc: large alloc 6645350400 bytes == 0x695ff4000 @ 0x7f6d5f840b6b\n", "unknown", "possible"),
    ("src/central_freelist.cc:333] tcmalloc: allocation failed 8192 \n", "unknown", "possible"),
    (
        "mimalloc: error: double free detected of block 0x020000001900 with size 48\n",
        "unknown",
        "possible",
    ),
    # a failed large allocation is decided by what followed it
    (
        "tcmalloc: large alloc 140113840283648 bytes == (nil) @  0x7f6eccf3b887\n"
        "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n",
        "abort",
        "certain",
    ),
]


_SPAWN_PARENT = f"""Traceback (most recent call last):
  File "/tmp/train.py", line 17, in <module>
    mp.spawn(fn, nprocs=2)
  File "/opt/torch/multiprocessing/spawn.py", line 211, in join
    raise ProcessRaisedException(msg, error_index, failed_process.pid)
torch.multiprocessing.spawn.ProcessRaisedException:{" "}

-- Process 1 terminated with the following error:
Traceback (most recent call last):
  File "/opt/torch/multiprocessing/spawn.py", line 87, in _wrap
    fn(i, *args)
  File "/tmp/train.py", line 5, in fn
    step(batch)
"""


@pytest.mark.parametrize(
    "last, kind",
    [
        ("KeyError: 'image'", "python_exception"),
        ("AssertionError", "python_exception"),  # an exception without a message
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 79.11 GiB of which 1.50 GiB is free.",
            "cuda_oom",
        ),
    ],
)
def test_a_spawned_child_s_relayed_exception_is_its_death(last, kind):
    """mp.spawn's child catches its exception, hands its traceback to the parent and exits 1
    (torch/multiprocessing/spawn.py _wrap): the relayed block's last exception line is the
    child's own cause, and the header's index its local rank."""
    doc = diagnose([LogInput("paste", _SPAWN_PARENT + last + "\n")])
    assert doc["killer"]["kind"] == kind, doc["killer"]
    (row,) = doc["ranks"]
    assert (row["local_rank"], row["exit_code"], row["fate"]) == (1, 1, "root_cause"), row


def test_a_spawned_child_ended_by_a_signal_is_not_told_why_by_spawn():
    """ProcessExitedException names the signal, not its sender: SIGKILL alone is unknown."""
    text = "torch.multiprocessing.spawn.ProcessExitedException: process 3 terminated with signal SIGKILL\n"
    assert _killer(text) == ("unknown", "possible")
    assert _killer("Exception: process 0 terminated with signal SIGKILL\n") == (
        "unknown",
        "possible",
    )  # torch < 1.8


RAY = [
    # the raylet's memory monitor, in the words of every version since 2.0
    (
        "ray.exceptions.OutOfMemoryError: 2 worker(s) were killed due to the node running low on memory. "
        "Memory on the node (IP: 10.0.0.3, ID: ab12) was 120.50GB / 125.00GB (0.964)\n",
        "userspace_oom",
        "likely",
    ),
    (
        "(raylet) Task compute_log_prob failed due to oom. There are infinite oom retries remaining, "
        "so the task will be retried. Error: 1 worker(s) were killed due to the node running low on "
        "memory.\n",
        "userspace_oom",
        "likely",
    ),
    # Ray's guess on any Kubernetes node is no verdict (ray-project/ray#42864: no OOM there)
    (
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
        "exit detail: Worker exits unexpectedly. Worker exits with an exit code 1. The worker may have "
        "exceeded K8s pod memory limits. The process receives a SIGTERM.\n",
        "unknown",
        "possible",
    ),
    # a Slurm step's OOM that took a Ray actor: Slurm's record decides, Ray's report does not
    (
        "slurmstepd: error: Detected 8 oom-kill event(s) in step 59137890.batch cgroup. Some of your "
        "processes may have been killed by the cgroup out-of-memory handler.\n"
        "ray.exceptions.RayActorError: The actor died unexpectedly before finishing this task.\n",
        "cgroup_oom",
        "likely",
    ),
    # a worker's own line behind Ray's prefix and its deduplication suffix
    (
        "(WorkerDict pid=27497, ip=10.0.0.3) RuntimeError: CUDA error: out of memory [repeated 2x "
        "across cluster] (Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log "
        "deduplication.)\n",
        "cuda_oom",
        "certain",
    ),
]


KUBERNETES = [
    # the kubelet stopping a container: deleted, evicted, preempted, scaled down; which, the
    # events beside it say
    ("  Normal   Killing    2m57s  kubelet  Stopping container trainer\n", "external_signal", "likely"),
    (
        "  Warning  Evicted    2m57s  kubelet  The node was low on resource: memory. Threshold quantity: "
        "100Mi, available: 87508Ki. Container w was using 580080Ki, request is 0, has larger consumption "
        "of memory.\n  Normal   Killing    2m57s  kubelet  Stopping container w\n",
        "userspace_oom",
        "likely",
    ),
    # a liveness kill under restartPolicy Never has no ", will be restarted"
    (
        "  Normal   Killing    6m8s   kubelet  Container trainer failed liveness probe\n",
        "external_signal",
        "likely",
    ),
    (
        "    message: 'Eviction API: evicting'\n    reason: EvictionByEvictionAPI\n",
        "external_signal",
        "likely",
    ),
    (
        "    message: 'Taint manager: deleting due to NoExecute taint'\n    reason: DeletionByTaintManager\n",
        "external_signal",
        "likely",
    ),
    # the eviction as the kubelet's own log and kubectl get pods' STATUS say it
    (
        'I1202 10:00:00.000000    1234 event.go:389] "Event occurred" object="ns/pod" kind="Pod" '
        'type="Warning" reason="Evicted" message="The node was low on resource: memory. "\n',
        "userspace_oom",
        "likely",
    ),
    ("istio-citadel-894d98c88-zkt23   0/1     Evicted   0          102d\n", "userspace_oom", "possible"),
    (
        'Warning  Failed  113s   kubelet  Error: container create failed: time="2022-09-14T11:35:13Z" '
        'level=error msg="runc create failed: unable to start container process: container init was '
        'OOM-killed (memory limit too low?)"\n',
        "cgroup_oom",
        "likely",
    ),
    # a status the kubelet made up (exit code 137 with no signal seen) decides nothing
    (
        "      Reason:       ContainerStatusUnknown\n"
        "      Message:      The container could not be located when the pod was terminated\n"
        "      Exit Code:    137\n",
        "unknown",
        "possible",
    ),
]


# torchrun's failure table whose "first observed failure" is a rank the agent SIGTERMed: the
# table orders by the exit the agent observed first, not by the first failure
def _table(code: str, traceback: str) -> str:
    failed = (
        "E1209 06:53:35.200000 812 torch/distributed/elastic/multiprocessing/api.py:869] failed "
        "(exitcode: -15) local_rank: 0 (pid: 813) of binary: /usr/bin/python3\n"
    )
    root = Failure(0, 0, -15, 813, "2024-12-09_06:53:34", "Signal 15 (SIGTERM) received by PID 813")
    return failed + failure_table(root, Failure(1, 1, int(code), 814, "2024-12-09_06:53:35", traceback))


@pytest.mark.parametrize(
    "words, code, kind, victim, fates",
    [
        # another rank's own failure came first: the SIGTERM is the agent's teardown
        (
            "[rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered\n",
            "-6",
            "gpu_error",
            1,
            {0: "terminated_by_agent", 1: "root_cause"},
        ),
        (
            "[rank1]: OSError: [Errno 28] No space left on device\n",
            "1",
            "python_exception",
            1,
            {0: "terminated_by_agent", 1: "root_cause"},
        ),
        # the other rank's words only report its peer's end: the SIGTERM stays the first death
        (
            "[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed "
            "by peer [10.0.0.2]:30872\n",
            "1",
            "external_signal",
            0,
            None,
        ),
        # no words, or every rank SIGTERMed (the agent itself was signalled): nothing to tie it to
        ("", "-6", "external_signal", 0, None),
        ("", "-15", "external_signal", 0, None),
    ],
)
def test_the_agent_s_sigterm_after_another_rank_s_own_failure_is_teardown(words, code, kind, victim, fates):
    traceback = f"Signal {-int(code)} received by PID 814" if code.startswith("-") else "To enable traceback"
    doc = diagnose([LogInput("paste", words + _table(code, traceback))])
    assert doc["killer"]["kind"] == kind and doc["victim"]["rank"] == victim, doc["killer"]
    if fates is not None:
        assert {r["rank"]: r["fate"] for r in doc["ranks"]} == fates


@pytest.mark.parametrize(
    "text, kind",
    [
        # a fixed message is named by its head, whatever a wrap did to its tail
        ("terminate called after throwing an instance of 'c10::DistBa\nckendError'\n", "abort"),
        ("[node-3:4242:0:4242] Caught signal 7 (Bus error: nonexistent phys\nical address)\n", "bus_error"),
        (
            "ERROR: Unexpected bus error encountered in worker. This might be caused by insu\n"
            "fficient shared memory (shm).\n",
            "bus_error",
        ),
        ("double free or corruption\nAborted (core dumped)\n", "abort"),
    ],
)
def test_a_message_wrapped_inside_its_tail_is_still_named(text, kind):
    assert _killer(text)[0] == kind


_FAMILIES = {"gpu-allocators": GPU_ALLOCATORS, "allocators": ALLOCATORS, "ray": RAY, "kubernetes": KUBERNETES}


@pytest.mark.parametrize(
    "text, kind, confidence",
    [
        pytest.param(*case, id=f"{family}-{i}")
        for family, cases in _FAMILIES.items()
        for i, case in enumerate(cases)
    ],
)
def test_a_family_s_own_words_yield_its_verdict(text, kind, confidence):
    assert _killer(text) == (kind, confidence)


_LOST = """    State:          Terminated
      Reason:       ContainerStatusUnknown
      Message:      The container could not be located when the pod was terminated
      Exit Code:    137
      Started:      Mon, 02 Dec 2024 10:00:00 +0000"""
_OOM = """    Last State:     Terminated
      Reason:       OOMKilled
      Exit Code:    137"""
_ERROR = """    State:          Terminated
      Reason:       Error
      Exit Code:    137"""


def test_the_kubelet_s_own_137_for_a_container_it_lost_is_no_sigkill():
    """ContainerStatusUnknown's exit code is written by the kubelet (kubelet_pods.go), not
    the status of a process: it vetoes the `Exit Code: 137` of its own record only."""
    lost = diagnose([LogInput("describe", _LOST)])["killer"]
    assert lost["kind"] == "unknown" and "SIGKILL" not in lost["summary"], lost
    plain = diagnose([LogInput("describe", _ERROR)])["killer"]
    assert plain["kind"] == "unknown" and "SIGKILL" in plain["summary"], plain  # a real 137 is one
    # another container's record, further down, is not vetoed
    other = diagnose(
        [LogInput("describe", _LOST + "\n      Finished:     -\n    Ready: False\n  sidecar:\n" + _OOM)]
    )
    assert (other["killer"]["kind"], other["killer"]["confidence"]) == ("cgroup_oom", "likely"), other[
        "killer"
    ]
    far = diagnose([LogInput("describe", _LOST + "\n" + "\n".join(["    Ready: False"] * 5) + "\n" + _ERROR)])
    assert "SIGKILL" in far["killer"]["summary"], far["killer"]


def test_a_veto_of_a_message_the_catalog_lacks_is_refused():
    from sidecar.catalog import CatalogError, load, texts

    files = texts()
    files["k8s.toml"] = files["k8s.toml"].replace('"k8s.exit_code_json"]', '"k8s.no_such_message"]')
    with pytest.raises(CatalogError, match=r"k8s\.no_such_message"):
        load(files)


_ECC = (
    'Traceback (most recent call last):\n  File "train.py", line 80, in <module>\n    loss.backward()\n'
    "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
)


def _termed(*ranks: int) -> str:
    fails = [
        Failure(r, r, -15, 501 + r, "2024-12-09_06:53:34", f"Signal 15 (SIGTERM) received by PID {501 + r}")
        for r in ranks
    ]
    return failure_table(fails[0], *fails[1:])


def test_a_device_fault_before_the_sigterms_is_the_failure_they_followed():
    """A rank whose CUDA context is lost cannot go on: it raises, aborts, or hangs until it
    is killed (the agent's SIGTERM, the SIGKILL after it), as a rank hung in a collective
    is. Its own words decide; words that name no rank, where every death is a SIGTERM,
    decide at possible and say no rank."""
    own = diagnose([LogInput("rank0", _ECC), LogInput("agent", _termed(0))])["killer"]
    assert (own["kind"], own["confidence"]) == ("gpu_error", "certain"), own
    unnamed = diagnose([LogInput("ranks", _ECC), LogInput("agent", _termed(0, 1))])["killer"]
    assert (unnamed["kind"], unnamed["confidence"]) == ("gpu_error", "possible"), unnamed
    assert unnamed["summary"].startswith("A rank (no line says which)"), unnamed["summary"]
    # every rank SIGTERMed and no fault said: a signal from outside, as before
    plain = diagnose([LogInput("agent", _termed(0, 1))])["killer"]
    assert plain["kind"] == "external_signal", plain
    # a rank that ended of its own beside them: the SIGTERMs are not all there is
    mixed = _termed(0) + "\n" + failure_table(Failure(1, 1, 1, 502, "2024-12-09_06:53:30", "<N/A>"))
    other = diagnose([LogInput("ranks", _ECC), LogInput("agent", mixed)])["killer"]
    assert "A rank (no line says which)" not in other["summary"], other


_RELAY_VALUES = {"task": "ff00", "worker": "ab12", "node_id": "cd34", "ip": "10.0.0.7", "port": "10046",
                 "pid": "4242", "pids": "4242", "count": "1", "exit_code": "-9", "rank": "3"}  # fmt: skip
_MEMORY_RECORDS = (
    (
        "slurmstepd: error: Detected 2 oom-kill event(s) in StepId=59137890.batch. Some of your "
        "processes may have been killed by the cgroup out-of-memory handler.",
        "cgroup_oom",
    ),
    ("Warning  Evicted  2m  kubelet  The node was low on resource: memory.", "userspace_oom"),
)


def _relayed() -> list[tuple[str, str]]:
    """Each catalog message that relays another process's abrupt death, rendered from its
    format, and torch's own DataLoader words for a worker killed by SIGKILL."""
    out = [
        (m.id, re.sub(r"\{(\w+)(?::\w+)?\}", lambda g: _RELAY_VALUES.get(g[1], "x"), m.format))
        for m in catalog().messages
        if m.relays_death
    ]
    return [*out, ("dataloader_killed", "DataLoader worker (pid 4242) is killed by signal: Killed.")]


@pytest.mark.parametrize(("record", "kind"), _MEMORY_RECORDS)
def test_an_exception_that_relays_an_abrupt_death_is_explained_by_a_memory_record(record, kind):
    """A driver that ends on an exception only relaying that a worker, an actor or a child
    died abruptly (no word of its own on why), in a job whose scheduler recorded a memory
    kill: the memory kill is why, at likely (the record names no pid). Without the record no
    killer is named beyond possible; an exception of the process's own is not explained by it."""
    trace = 'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n    run()\n'
    for mid, relay in _relayed():
        last = relay if "Error:" in relay else f"RuntimeError: {relay}"
        text = trace + last + "\n"
        with_record = diagnose([LogInput("driver", text), LogInput("scheduler", record)])["killer"]
        assert (with_record["kind"], with_record["confidence"]) == (kind, "likely"), (mid, with_record)
        alone = diagnose([LogInput("driver", text)])["killer"]
        answer = (alone["kind"], alone["confidence"])
        assert answer in (("python_exception", "possible"), ("unknown", "possible")), (mid, alone)
    own = trace + "KeyError: 'labels'\n"
    mine = diagnose([LogInput("driver", own), LogInput("scheduler", record)])["killer"]
    assert mine["kind"] == "python_exception", mine


@pytest.mark.parametrize(
    "heap",
    ["malloc_consolidate(): invalid chunk size", "corrupted double-linked list", "free(): invalid pointer"],
)
def test_a_heap_found_corrupt_first_is_how_the_process_died_not_its_workers_crashes_after(heap):
    """glibc checks its heap and calls abort() when a check fails: the process's own word on
    the fatal signal it is about to raise. A heap corrupted in a process that forked
    DataLoader workers may crash them after it (Paddle's worker handler reports each
    SIGSEGV): the first fatal event decides; had a worker crashed first, its crash would."""
    worker = "ERROR: Unexpected segmentation fault encountered in DataLoader workers."
    text = "\n".join(["epoch 11 step 300 loss 0.41", heap, worker, worker])
    killer = diagnose([LogInput("rank", text)])["killer"]
    assert killer["kind"] == "abort" and killer["confidence"] == "certain", killer
    first = "\n".join(["epoch 11 step 300 loss 0.41", worker, heap])
    assert diagnose([LogInput("rank", first)])["killer"]["kind"] == "segfault"
