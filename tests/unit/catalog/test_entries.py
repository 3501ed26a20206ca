"""The emitter catalog (sidecar/catalog/*.toml): every entry is well formed, its pattern
finds the text its format renders with random values (and captures them), and it finds its
real public logs, which never come from a held-out thread of the corpus."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.catalog import Catalog, CatalogError, Message, catalog, load, texts
from sidecar.model import Confidence
from tests.support.catalog_formats import placeholders, render
from tests.support.corpus import half

# the emitters the issue names, each at least one file's worth
EMITTERS = {
    "torchelastic",  # torch.distributed.elastic agent, error files, torch.distributed.launch, spawn
    "c10d",  # ProcessGroupNCCL, gloo, the store, the flight recorder
    "python",  # tracebacks, faulthandler, MemoryError, the DataLoader
    "cuda",  # every cudaError_t text
    "nccl",  # NCCL's own warnings and ncclResult_t
    "nvrm",  # the driver's Xid records, GPU lost
    "linux",  # OOM killer and memory cgroup records, segfault records
    "libc",  # glibc, libstdc++, shells
    "mpi",  # UCX, HPC-X, Open MPI, MPICH banners
    "oomd",  # systemd-oomd, earlyoom, nohang, oomd, Talos
    "k8s",  # kubelet, container statuses, events, Kubeflow, Docker
    "slurm",  # slurmstepd, srun, states
    "launchers",  # DeepSpeed, accelerate, Lightning, Ray
    "tvmffi",  # TVM FFI's SIGSEGV handler (xgrammar, FlashInfer)
    "systemd",  # systemd-logind's power key (a machine shut down from outside)
    "xla",  # XLA/TSL's coordination service (jax.distributed)
    "submitit",  # submitit's Slurm time-limit and preemption signal handler
    "sighandlers",  # glog's, folly's and PaddlePaddle's fatal-signal banners
    "yarn",  # Hadoop YARN's NodeManager memory monitor, Spark's YARN allocator
    "hsa",  # ROCm's HSA runtime: a GPU memory access fault
    "sglang",  # SGLang's watchdog (a hang killed)
    "mxnet",  # MXNet's storage managers, CUDA checks, signal handlers, dmlc tracker
    "paddle",  # PaddlePaddle's enforce errors, allocators, store and comm-task timeouts, DataLoader
    "tensorflow",  # TensorFlow's GPU setup, collectives, multi-worker health, fatal logs
    "tcnn",  # tiny-cuda-nn's CUDA checks and GPU memory arena
    "caffe2",  # Caffe2's GPU allocator checks (Detectron's words)
    "iris",  # marin's Iris scheduler: task exits, a gang's teardown
    "vllm",  # vLLM's engine core, executors and workers: deaths told by a peer, KV-cache errors
}

MESSAGES = load(texts()).messages  # raises what is wrong with a shipped file
IDS = [m.id for m in MESSAGES]

_plain = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;-_/=",
    min_size=1,
    max_size=40,
).map(lambda s: s.strip() or "x")
_STRATEGIES: dict[str, st.SearchStrategy[str]] = {
    "int": st.integers(-(2**31), 2**31).map(str),
    "uint": st.integers(0, 2**32).map(str),
    "hex": st.integers(0, 2**64 - 1).map(hex),
    "float": st.tuples(st.integers(0, 10**6), st.integers(0, 99)).map(lambda t: f"{t[0]}.{t[1]:02d}"),
    "word": st.from_regex(r"[A-Za-z0-9_]{1,16}", fullmatch=True),
    "name": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}", fullmatch=True),
    "path": st.from_regex(r"(/[A-Za-z0-9._-]{1,10}){1,5}", fullmatch=True),
    "text": _plain,
    "size": st.tuples(
        st.integers(0, 9999), st.integers(0, 99), st.sampled_from(["B", "KiB", "MiB", "GiB", "TiB"])
    ).map(lambda t: f"{t[0]}.{t[1]:02d} {t[2]}"),
    "signal": st.sampled_from(
        ["SIGKILL", "SIGTERM", "SIGSEGV", "SIGBUS", "SIGABRT", "SIGINT", "SIGHUP", "SIGUSR1"]
    ),
    "time": st.sampled_from(
        ["2026-12-02T11:53:34", "2026-12-02 11:53:34", "11:53:34", "2026-12-02T11:53:34.123456"]
    ),
}


def test_the_catalog_loads_and_names_every_emitter():
    assert len(MESSAGES) >= 150
    assert set(catalog().emitters()) >= EMITTERS, EMITTERS - set(catalog().emitters())
    assert len(set(IDS)) == len(IDS)
    assert [m.id for m in catalog().messages] == IDS  # the daemon's catalog is the whole one
    assert set(texts()) == {f"{e}.toml" for e in catalog().emitters()}  # one file an emitter


@pytest.mark.parametrize("message", MESSAGES, ids=IDS)
def test_an_entry_is_well_formed(message: Message):
    assert message.source.strip() and message.versions.strip() and message.mechanism.strip()
    assert message.says.strip()
    for name in re.findall(r"\{(\w+)\}", message.says):  # filled from what the pattern captured
        assert name in message.pattern.groupindex, (
            f"{message.id}: says {{{name}}}, the pattern has no such group"
        )
    for name, typ in placeholders(message.format):
        assert typ in _STRATEGIES, f"{message.id}: placeholder {name} has an unknown type {typ}"
    if message.confidence == Confidence.CERTAIN:
        # certain only from a first-hand record: the dying process's or its killer's own word
        assert message.first_hand, message.id
    if message.layer == "report":  # what happened elsewhere: never more than possible alone
        assert (
            message.kind is None
            or message.kind.value == "agent_teardown"
            or message.confidence == Confidence.POSSIBLE
        )
    if message.relays_death:  # another's death, told without its cause: it names no killer
        assert message.kind is None and message.layer == "report", message.id
    if message.caught:  # a handler's report, from inside the process, of the signal it caught
        assert message.layer == "symptom" and message.first_hand, message.id
    assert message.anchors and min(map(len, message.anchors)) >= 3, (
        f"{message.id}: the pattern has no literal words to look for: {message.anchors}"
    )


@pytest.mark.parametrize("message", MESSAGES, ids=IDS)
def test_an_entry_finds_what_its_format_renders(message: Message):
    """Property: whatever values fill the format's placeholders, the pattern finds the text
    and each named group that is a placeholder captures its value (or text around it)."""
    fields = placeholders(message.format)
    strategy = st.fixed_dictionaries({name: _STRATEGIES[typ] for name, typ in fields})

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(values: dict[str, str]) -> None:
        text = render(message.format, values)
        found = message.pattern.search(text)
        assert found is not None, f"{message.id}: {text!r}"
        assert [h.message.id for h in catalog().scan(text) if h.message.id == message.id] == [message.id]
        for group in message.pattern.groupindex:
            if group in values and found[group] is not None:
                assert values[group] in found[group] or found[group] in values[group], (group, text)

    check()


@pytest.mark.parametrize("message", [m for m in MESSAGES if m.real], ids=[m.id for m in MESSAGES if m.real])
def test_an_entry_finds_its_real_public_log(message: Message):
    for url, text in message.real:
        assert url.startswith("https://"), url
        assert half(url) == "dev", f"{message.id}: a real example from a held-out thread: {url}"
        lines = text.splitlines() or [text]
        assert any(message.id in {h.message.id for h in catalog().scan(line)} for line in lines), (
            message.id,
            text[:200],
        )


def test_the_share_of_entries_with_a_real_public_log_does_not_fall():
    """The goal is a real log for every entry; the rarest cudaError_t texts, and messages
    whose public logs all sit in held-out threads, have none yet. This floor (the share
    reached on 2026-12-04: 346 of 500) only keeps it from falling."""
    with_real = sum(1 for m in MESSAGES if m.real)
    assert with_real >= 0.68 * len(MESSAGES), f"{with_real} of {len(MESSAGES)}"


def test_an_entry_no_real_log_confirms_never_decides_certain():
    """Its pattern is the source's word only: the loader caps it at likely."""
    raw = texts()["cuda.toml"]
    capped = load({"cuda.toml": raw})
    for m in capped.messages:
        if not m.real:
            assert m.confidence != Confidence.CERTAIN, m.id
    head, *entries = raw.split("[[message]]")
    first = next(e for e in entries if 'confidence = "certain"' in e and "[[message.real]]" in e)
    bare = first[: first.index("[[message.real]]")]
    one = load({"cuda.toml": head + "[[message]]" + bare})
    assert one.messages[0].confidence == Confidence.LIKELY
    assert load({"cuda.toml": head + "[[message]]" + first}).messages[0].confidence == Confidence.CERTAIN


def _unbounded(items: object) -> list[str]:
    """The repeats of a parsed pattern with no upper bound (``*``, ``+``, ``{n,}``)."""
    from re import _parser as parser  # type: ignore[attr-defined]

    found = []
    for op, arg in items:  # type: ignore[attr-defined]
        if op in (parser.MAX_REPEAT, parser.MIN_REPEAT):
            if arg[1] == parser.MAXREPEAT:
                found.append(str(op))
            found += _unbounded(arg[2])
        elif op is parser.SUBPATTERN:
            found += _unbounded(arg[3])
        elif op is parser.BRANCH:
            for alternative in arg[1]:
                found += _unbounded(alternative)
    return found


@pytest.mark.parametrize("message", MESSAGES, ids=IDS)
def test_a_pattern_repeats_nothing_without_bound(message: Message):
    """Logs are hostile input: every repeat in a pattern has an upper bound (README), so no
    line can make a scan backtrack without end."""
    from re import _parser as parser  # type: ignore[attr-defined]

    assert not _unbounded(parser.parse(message.pattern.pattern, message.pattern.flags)), message.id


def test_hostile_lines_are_scanned():
    """Long lines of the characters patterns repeat on, and a line holding every message's
    words, are scanned to an answer (bounded patterns: the test above)."""
    cat = catalog()
    hostile = [
        "a" * 100_000,
        "(" * 50_000,
        "0" * 50_000,
        " " * 50_000 + "x",
        "CUDA error: " * 5000,
        "Killed process " + "9" * 10_000,
        "".join(m.anchors[0] for m in cat.messages)[:4096],
    ]
    for line in hostile:
        assert isinstance(cat.scan(line), list)


def test_a_bad_catalog_file_is_one_clear_error():
    head = '[emitter]\nid = "x"\nname = "x"\nsources = ["x"]\nchannel = "output"\n[[message]]\n'
    good = "\n".join(
        [
            'id = "x.a"',
            'versions = "1"',
            'source = "s"',
            'format = "boom {n:int}"',
            "pattern = 'boom (?P<n>-?\\d+)'",
            'kind = "abort"',
            'layer = "symptom"',
            'confidence = "likely"',
            "first_hand = true",
            'mechanism = "m"',
            'says = "s"',
            "",
        ]
    )
    assert isinstance(load({"x.toml": head + good}), Catalog)
    for bad, words in (
        (good.replace('id = "x.a"', 'id = "y.a"'), "starts with its emitter"),
        (good.replace('layer = "symptom"', 'layer = "cause"'), "layer"),
        (good.replace('kind = "abort"', 'kind = "oom"'), "oom"),
        (good.replace("boom (?P<n>", "boom ((?P<n>"), "pattern"),
        (good.replace('says = "s"\n', ""), "missing says"),
        (good + 'channel = "stdout"\n', "channel"),
    ):
        with pytest.raises(CatalogError, match=words):
            load({"x.toml": head + bad})
    with pytest.raises(CatalogError, match="second message"):
        load({"x.toml": head + good + "[[message]]\n" + good})


_REAL_LINES = [line for m in MESSAGES for _, text in m.real for line in text.splitlines()]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    picks=st.lists(st.sampled_from(_REAL_LINES), max_size=30),
    noise=st.lists(st.text(max_size=120).filter(lambda t: "\n" not in t and "\r" not in t), max_size=30),
    seed=st.randoms(use_true_random=False),
)
def test_scanning_a_whole_text_finds_what_scanning_each_line_finds(picks, noise, seed):
    """``scan_lines`` (every anchor looked for once in the text) gives each line the hits
    ``scan`` gives it, in the same order: real messages mixed with arbitrary lines, lines
    past LINE_MAX, empty lines, a message glued after a long prefix."""
    lines = picks + noise + ["", "x" * 5000 + (picks[0] if picks else "")]
    seed.shuffle(lines)
    for part in (
        catalog(),
        catalog().part("output", deciding=True),
        catalog().part("agent", "shell", "scheduler"),
    ):
        got = [[(h.message.id, h.fields) for h in hits] for hits in part.scan_lines(lines)]
        assert got == [[(h.message.id, h.fields) for h in part.scan(line)] for line in lines]


@pytest.mark.parametrize("message", MESSAGES, ids=IDS)
def test_a_says_with_nothing_captured_leaves_no_empty_words(message: Message):
    """A pattern's optional groups may capture nothing (a paste cut the line, a version prints
    less): the sentence then leaves the value out with the words that name it (no "on rank."
    of nobody, no "(seq )", no "after  ms")."""
    said = message.said({})
    assert "\x00" not in said and "()" not in said and "  " not in said, said
    assert not re.search(r"\b(?:on rank|seq|after)\s*(?:[.,:;)]|$)", said), said
