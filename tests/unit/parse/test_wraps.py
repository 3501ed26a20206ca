"""No catalog message is lost to a wrap: every deciding message's real public lines,
pasted among other lines of a log and wrapped at 80 and 120 columns as a terminal and as
a web page does, is found again once the paste is made plain, with the same fields (a
space a wrap moved inside a free-text field aside). Generated from the catalog itself, so
an entry added later is held to it too."""

from __future__ import annotations

import re
import zlib

import pytest

from sidecar.catalog import Hit, Message, catalog
from sidecar.diagnose import LogInput, diagnose
from sidecar.parse.pasted import plain
from tests.support.pastes import PERTURBATIONS

# the lines around the message: a launcher's long warning, a traceback, a progress bar;
# short lines only; long records of nearly one width (a config dump)
_AROUND = [
    "W1202 11:53:35.000000 4200 torch/distributed/run.py:793] Setting OMP_NUM_THREADS environment "
    "variable for each process to be 1 in default, to avoid your system being overloaded, please "
    "further tune the variable for optimal performance in your application as needed.",
    "Traceback (most recent call last):",
    '  File "/workspace/train.py", line 412, in <module>',
    "    main()",
    "{'loss': 2.3141, 'grad_norm': 1.0391845703125, 'learning_rate': 1.9999e-05, 'epoch': 0.01}",
    "  0%|          | 12/10000 [00:31<7:12:44,  2.60s/it]",
]
_AFTER = [
    "E1202 11:53:36.000000 4200 torch/distributed/elastic/multiprocessing/api.py:869] failed "
    "(exitcode: 1) local_rank: 0 (pid: 4242) of binary: /usr/bin/python3",
    "Traceback (most recent call last):",
    '  File "/usr/local/bin/torchrun", line 8, in <module>',
    "    sys.exit(main())",
]
_SHORT = ["Epoch 1/10", "step 120 loss 2.31", "Traceback (most recent call last):", '  File "t.py", line 3']
_DUMP = [
    f"[2024-05-0{i} 10:0{i}:11,5{i}3] [INFO] [config.py:98{i}:print]   zero_optimization_stage_{i} "
    f"..... {{'stage': {i}, 'offload_param': {{'device': 'cpu', 'pin_memory': True, 'buffer_count': "
    f"5}}, 'reduce_bucket_size': 500000000}}"
    for i in range(1, 8)
]
CONTEXTS = {"launcher": (_AROUND, _AFTER), "short": (_SHORT, _SHORT), "dump": (_DUMP, _DUMP[:3] + _AFTER)}
# what a rank's or a worker's line may carry before the message (output channel only)
PREFIXES = ("", "[rank1]: ", "[default3]:", "(RayWorker pid=1450) ")
WRAPS = ("wrap80", "wrap120", "web80", "web120")


Found = tuple[str, tuple[tuple[str, str], ...]]


def _found(hit: Hit) -> Found:
    return hit.message.id, tuple((k, "".join((v or "").split())) for k, v in hit.fields)


def _messages(text: str, message: Message) -> set[Found]:
    cat = catalog()
    return {_found(h) for line in plain(text).split("\n") for h in cat.scan(line) if h.message is message}


def _kept(whole: Found, wrapped: set[Found], message: Message) -> bool:
    """The message found again with each field's value, or with a value cut short where a
    field takes the rest of the line (a wrap may leave its tail on the next line, which
    no message shape says is its own)."""
    rest = _TAKES_THE_REST.get(message.id, ())

    def same(k: str, v: str, got: dict[str, str]) -> bool:
        return got.get(k) == v or (k in rest and bool(got.get(k)) and v.startswith(got[k]))

    return any(all(same(k, v, dict(fields)) for k, v in whole[1]) for _, fields in wrapped)


def _rest_fields(message: Message) -> tuple[str, ...]:
    """The fields of a pattern that take any text to the end of the line (after a first
    character of a class, short of a closing bracket), or that end the pattern (a status
    word, a host name: the line may go on, but a wrap cuts them as well)."""
    return tuple(
        name
        for name in message.pattern.groupindex
        if re.search(
            rf"\(\?P<{name}>(?:\[[^\]]{{1,20}}\])?(?:\[\^[^\]]{{0,6}}\\n\]|\.)\{{\d+,\d+\}}\)",
            message.pattern.pattern,
        )
        or re.search(rf"\(\?P<{name}>[^()]{{1,60}}\)$", message.pattern.pattern)
    )


_TAKES_THE_REST = {m.id: _rest_fields(m) for m in catalog().messages}


def _cases() -> list[tuple[Message, str, str, tuple[list[str], list[str]]]]:
    """Each deciding message's real lines, each with a prefix and lines around it, in turn."""
    out = []
    contexts = list(CONTEXTS.items())
    for m in catalog().messages:
        if not m.decides:
            continue
        for _, text in m.real:
            line = next((x for x in text.split("\n") if m.pattern.search(x)), None)
            if line is not None:
                k = zlib.crc32(
                    f"{m.id} {line}".encode()
                )  # each line's turn its own: entries added elsewhere move none
                prefix = PREFIXES[k % len(PREFIXES)] if m.channel == "output" else ""
                name, around = contexts[k % len(contexts)]
                out.append((m, prefix + line, name, around))
    return out


@pytest.mark.parametrize("wrap", WRAPS)
def test_no_deciding_message_is_lost_to_a_wrap(wrap):
    cut = PERTURBATIONS[wrap]
    tried, lost, cases = 0, [], _cases()
    for message, line, context, (before, after) in cases:
        text = "\n".join([*before, line, *after])
        whole = _messages(text, message)
        if not whole:
            continue  # a neighbour's words take it as collected: not a wrap's doing
        tried += 1
        wrapped = _messages(cut([("rank_stderr", text)])[0][1], message)
        if not all(_kept(found, wrapped, message) for found in whole):
            lost.append(f"{message.id} ({context}): {line[:120]}")
    assert tried > 250 and tried > 0.95 * len(cases), (tried, len(cases))  # every real line, near enough
    assert not lost, "\n".join(lost)


def _gloo_traceback(depth: int) -> list[str]:
    """A traceback through long site-packages paths whose exception carries a path longer
    than a page's width (gloo's source location), as torch 1.x printed it."""
    lines = ["Traceback (most recent call last):"]
    for i in range(depth):
        lines += [
            f'  File "/opt/conda/envs/train{i}/lib/python3.7/site-packages/torch/autograd/__init__.py", '
            f"line {150 + i}, in backward",
            f"    Variable._execution_engine.run_backward(tensors{i}, grad_tensors_, retain_graph, "
            "create_graph)",
        ]
    where = "/opt/conda/conda-bld/pytorch_1634272168290/work/third_party/gloo/gloo/transport/tcp/pair.cc:598"
    return [*lines, f"RuntimeError: [{where}] Connection closed by peer [10.0.0.7]:12717"]


@pytest.mark.parametrize("wrap", ["web80", "web120", "wrap80", "wrap120"])
def test_a_traceback_s_last_line_is_its_own_under_a_wrap(wrap):
    """A page puts an exception's name alone on a line when its first word (a path) does not
    fit, and cuts that word at the width; a traceback's last line is a record of its own,
    never glued to the frame above it."""
    lines = _gloo_traceback(4)
    ((_, text),) = PERTURBATIONS[wrap]([("rank_stderr", "\n".join(lines))])
    assert plain(text).split("\n")[-1] == lines[-1]


def test_a_quote_copied_under_line_numbers_or_task_ids_is_taken_off():
    lines = [
        "> [rank1]: Traceback (most recent call last):",
        '> [rank1]:   File "t.py", line 3',
        "> [rank1]: KeyError: 'x'",
    ]
    for family in ("line_numbers", "srun"):
        ((_, text),) = PERTURBATIONS[family]([("rank_stderr", "\n".join(lines))])
        assert plain(text).split("\n")[-1].endswith("[rank1]: KeyError: 'x'"), (family, plain(text))


def test_a_record_above_does_not_decide_how_a_page_s_break_is_undone():
    """XLA's allocator retries a smaller size after each failure, one line each, and a page
    breaks every line after ``from device:``. Undone, each record gets its space back: the
    record above already reads the retry message whichever way this break is undone, so it
    must not make the spaceless join look as if it read more (glued, ``from
    device:CUDA_ERROR_OUT_OF_MEMORY`` reads as a CUDA OOM no allocator reported)."""
    ladder = [
        f"failed to allocate {size} ({size_bytes} bytes) from device: CUDA_ERROR_OUT_OF_MEMORY: out of memory"
        for size, size_bytes in (
            ("12.00G", 12884901888),
            ("10.80G", 11596411699),
            ("9.72G", 10436770529),
            ("8.75G", 9393093476),
        )
    ]
    error = "ValueError: worker 3 was pinned to visible device index 5 but the host exposes 4 GPUs"
    text = "\n".join([*ladder, error])
    ((_, wrapped),) = PERTURBATIONS["web80"]([("rank_stderr", text)])
    assert "from device: CUDA_ERROR" in plain(wrapped) and "device:CUDA" not in plain(wrapped)
    doc = diagnose([LogInput("rank_stderr", wrapped)])
    assert doc["killer"]["kind"] == "python_exception", doc["killer"]


def test_a_break_inside_a_message_s_second_line_reads_with_its_head_above():
    """Horovod's stall warning runs over three lines of a page at 120 columns, and the
    tensor names below it are longer than the page, cut at its width with no space to break
    at: the paste reads as a terminal's wrap, and the warning's one line exactly as wide as
    the page was glued to the next without its space (``more`` + ``than``). Whether the space
    comes back is read with the line above, where the message's head is."""
    names = ", ".join(
        f"model/encoder/layer_{i}/attention/self/HorovodAllreduce_model_encoder_layer_{i}"
        "_attention_self_query_kernel_grad_0_cast_to_fp16_x"
        for i in range(4)
    )
    text = "\n".join(
        [
            "[2023-03-14 09:12:07.123456: W /opt/venv/lib/site-packages/horovod/common/"
            "stall_inspector.cc:105] One or more tensors were submitted to be reduced, gathered "
            "or broadcasted by subset of ranks and are waiting for remainder of ranks for more "
            "than 60 seconds. This may indicate that different ranks are trying to submit "
            "different tensors or that only subset of ranks is submitting tensors, which will "
            "cause deadlock.",
            "Missing ranks:",
            f"3: [{names}]",
        ]
    )
    ((_, wrapped),) = PERTURBATIONS["web120"]([("rank_stderr", text)])
    assert 120 in [len(line) for line in wrapped.split("\n")]  # the case: a piece as wide as the page
    assert "for more than 60 seconds" in plain(wrapped)
    doc = diagnose([LogInput("rank_stderr", wrapped)])
    assert doc["killer"]["kind"] == "collective_timeout", doc["killer"]


def test_a_message_s_words_across_a_break_outweigh_a_free_text_field_running_on():
    """A page breaks torch's watchdog timeout between ``collective`` and ``operation``, and
    that piece is the paste's widest line: a terminal's cut would end there too, where a
    free-text field (``DistBackendError: <any text>``) runs on either way. The watchdog's own
    words read across the break only with the space back, and decide."""
    text = "\n".join(
        [
            "torch.distributed.DistBackendError: [Rank 2] Watchdog caught collective operation timeout: ",
            "WorkNCCL(SeqNum=2291, OpType=BROADCAST, NumelIn=<n>, NumelOut=<n>, Timeout(ms)=900000) ",
            "ran for 900417 milliseconds before timing out.",
        ]
    )
    ((_, wrapped),) = PERTURBATIONS["web80"]([("rank_stderr", text)])
    assert "Watchdog caught collective\noperation" in wrapped  # the break the test is about
    assert "collective operation timeout" in plain(wrapped)
    doc = diagnose([LogInput("rank_stderr", wrapped)])
    assert doc["killer"]["kind"] == "collective_timeout", doc["killer"]


@pytest.mark.parametrize("wrap", ["wrap80", "web80"])
@pytest.mark.parametrize("word", ["Killed", "Segmentation fault (core dumped)", "Aborted (core dumped)"])
def test_a_shell_s_word_after_a_line_as_wide_as_the_page_is_its_own(wrap, word):
    """The shell writes its word on its child's death alone on a line. After a record exactly
    as wide as the copy (a terminal's full line, a page's long one), it is no piece of it."""
    exact = "INFO 12-06 11:53:34 engine.py:310] Avg generation throughput: 1532.4 tokens/s, r"
    assert len(exact) == 80
    long = [f"step {i}: " + "x" * 90 for i in range(4)]  # wrapped: the copy is a terminal's or a page's
    text = "\n".join([*long, exact, word])
    ((_, wrapped),) = PERTURBATIONS[wrap]([("rank_stderr", text)])
    assert word in plain(wrapped).split("\n")


@pytest.mark.parametrize("wrap", ["wrap80", "wrap120", "web80", "web120"])
def test_nccl_s_debug_lines_after_a_wrapped_record_stay_lines_of_their_own(wrap):
    """NCCL starts every debug line with ``host:pid:tid [dev] NCCL``: a record of its own. A
    long host name as its first word never fits the line above, which reads to a page's
    unwrap like a break; the lines stay apart and the rank the watchdog names stays the
    victim."""
    watchdog = (
        "[E ProcessGroupNCCL.cpp:475] [Rank 15] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=96383, OpType=_ALLGATHER_BASE, NumelIn=88200, NumelOut=5644800, "
        "Timeout(ms)=7200000) ran for 7200520 milliseconds before timing out."
    )
    host = "job-20240517230118-abcde-worker-1"
    said = "NCCL INFO [Service thread] Connection closed by localRank 7"
    nccl = [f"{host}:51{i}3:52{i}1 [{i}] {said}" for i in range(5)]
    ((_, wrapped),) = PERTURBATIONS[wrap]([("rank_stderr", "\n".join([watchdog, *nccl]))])
    lines = plain(wrapped).split("\n")
    assert all(line in lines for line in nccl), lines
    doc = diagnose([LogInput("rank_stderr", wrapped)])
    assert doc["killer"]["kind"] == "collective_timeout" and doc["victim"]["rank"] == 15, doc["victim"]


def test_the_watchdog_s_words_read_by_the_catalog_alone_say_what_its_fields_would():
    """Ranks that all report the watchdog's timeout (nobody says why the missing one never
    came): the collective timed out, at possible, whether the lines are read field by field
    or, a wrap having cut a field under srun's task ids, only as the catalog's words."""

    def watchdog(rank: int, cut: bool) -> list[str]:
        line = (
            f"[rank{rank}]:[E ProcessGroupNCCL.cpp:563] [Rank {rank}] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=15037, OpType=_ALLGATHER_BASE, NumelIn=131072512, NumelOut=524290048, "
            f"Timeout(ms)=600000) ran for 60005{rank} milliseconds before timing out."
        )
        at = line.index("ut(ms)")
        return [f"{rank}: {line[:at]}", f"{rank}: {line[at:]}"] if cut else [line]

    for cut in (False, True):
        text = "\n".join(line for rank in (3, 1, 2) for line in watchdog(rank, cut))
        doc = diagnose([LogInput("rank_stderr", text)])
        assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("collective_timeout", "possible"), (
            cut,
            doc["killer"],
        )
