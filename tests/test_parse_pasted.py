"""Logs as people paste them (sidecar/parse/pasted.py): colours, carriage returns, prefix
families and wrapped lines undone, on generated text and on the verdicts diagnose gives."""

from __future__ import annotations

import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.diagnose import LogInput, diagnose
from sidecar.parse.pasted import plain

AGENT = [
    "W1202 11:53:35.000000 4200 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 4241 "
    "closing signal SIGTERM",
    "E1202 11:53:36.000000 4200 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -6) "
    "local_rank: 1 (pid: 4242) of binary: /usr/bin/python3",
]
RANK = [
    "[rank1]:[E1202 11:53:30.123456789 ProcessGroupNCCL.cpp:1834] [PG ID 0 PG GUID 0(default_pg) Rank 1] "
    "Process group watchdog thread terminated with exception: CUDA error: an illegal memory access was "
    "encountered",
    "[rank1]: terminate called after throwing an instance of 'c10::DistBackendError'",
]


def test_colours_and_carriage_returns_are_removed():
    assert plain("\x1b[31mRuntimeError: boom\x1b[0m\r\nnext\r") == "RuntimeError: boom\nnext"
    assert plain("10%|#   |\r50%|#####  |\rdone") == "done"  # a redrawn progress bar keeps its last state


def test_runtime_and_kubectl_prefixes_are_dropped():
    line = "Killed process 4242 (python) total-vm:1kB, anon-rss:1kB, file-rss:0kB, shmem-rss:0kB"
    assert plain(f"2026-12-02T11:53:34.123456789Z stderr F {line}") == line
    assert plain(f"2026-12-02T11:53:34.123456789+01:00 stdout P {line}") == line
    assert plain(f"[pod/trainer-0/pytorch] {line}") == line


def test_srun_task_ids_become_rank_prefixes():
    text = "\n".join(["0: starting", "1: starting", "1: RuntimeError: boom", "0: done"])
    assert plain(text).splitlines() == ["[rank0]:starting", "[rank1]:starting", "[rank1]:RuntimeError: boom",
                                        "[rank0]:done"]  # fmt: skip
    # one line that happens to start with a number is not a prefix family
    assert plain("3: something\nother\nlines\nhere") == "3: something\nother\nlines\nhere"


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("words", [True, False])
def test_a_wrapped_message_is_joined_back(width, words):
    """A terminal breaks inside words; a web page's copy breaks between them."""
    text = "\n".join(AGENT + RANK)
    if words:
        wrapped = "\n".join(
            textwrap.fill(line, width, break_long_words=True, break_on_hyphens=False)
            for line in text.splitlines()
        )
    else:
        wrapped = "\n".join(
            line[i : i + width] for line in text.splitlines() for i in range(0, len(line), width)
        )
    assert wrapped != text
    assert "closing signal SIGTERM" in plain(wrapped)
    assert "failed (exitcode: -6) local_rank: 1 (pid: 4242)" in plain(wrapped)
    if not words:  # a terminal's fixed width: every record whole again
        assert plain(wrapped) == text


@pytest.mark.parametrize("width", [80, 120])
def test_the_verdict_does_not_change_when_the_log_is_wrapped(width):
    text = "\n".join(AGENT + RANK)
    cut = "\n".join(line[i : i + width] for line in text.splitlines() for i in range(0, len(line), width))
    whole, wrapped = diagnose([LogInput("log", text)]), diagnose([LogInput("log", cut)])
    assert whole["killer"]["kind"] == "gpu_error", whole["killer"]
    for key in ("kind", "confidence", "summary"):
        assert wrapped["killer"][key] == whole["killer"][key]


def test_separate_lines_are_not_joined():
    text = "\n".join(["RuntimeError: first", "ValueError: second", "Killed", "epoch 3 done"])
    assert plain(text) == text


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x2FF), max_size=120), max_size=30)
)
def test_any_text_is_read_and_never_grows(lines):
    """Hostile input: whatever the lines, plain returns text no longer than what came in."""
    text = "\n".join(lines)
    out = plain(text)
    assert isinstance(out, str) and len(out) <= len(text) + len(lines)
