"""The message families the catalog learnt in the fourth wave, by what a paste of their own
words must yield (each entry's pattern is tested on its format and its real log in
tests/test_catalog.py): the verdict, its confidence, and the words that must decide nothing."""

from __future__ import annotations

import pytest

from sidecar.diagnose import LogInput, diagnose


def _killer(text: str) -> tuple[str, str]:
    k = diagnose([LogInput("paste", text)])["killer"]
    return k["kind"], k["confidence"]


_TF = "tensorflow/stream_executor/cuda/cuda_driver.cc"
_TMS = "[torch_memory_saver.cpp]"


@pytest.mark.parametrize(
    "text, kind, confidence",
    [
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
    ],
)
def test_gpu_allocators_words(text, kind, confidence):
    assert _killer(text) == (kind, confidence)
