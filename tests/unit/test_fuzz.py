"""Every parser and input the daemon reads, fuzzed on a small fixed budget (tests/support/fuzz.py
says how; ``make fuzz`` runs the same targets much longer and times them): no exception
outside a target's contract escapes, and every crasher found so far stays fixed."""

from __future__ import annotations

import contextlib

import pytest

from tests.support import fuzz

TARGETS = {t.name: t for t in fuzz.targets()}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_no_input_crashes_a_parser(name):
    out = fuzz.run(TARGETS[name], fuzz.budget())
    assert out.calls >= min(fuzz.budget(), 50), out  # the inputs were generated and fed
    assert not out.crashers, out.crashers


@pytest.mark.parametrize(("name", "value"), fuzz.regressions())
def test_crashers_found_by_fuzzing_stay_fixed(name, value):
    target = TARGETS[name]
    with contextlib.suppress(*target.allowed):
        target.call(value)


def test_the_corpus_is_real_text_of_every_kind():
    sizes = {k: len(v) for k, v in fuzz.corpus().items()}
    assert all(n >= 3 for n in sizes.values()), sizes
    assert {"stat", "status", "environ", "cmdline", "cgroup", "meminfo"} <= set(fuzz.proc_files())
    assert len(fuzz.regressions()) >= 9  # the crashers kept so far are all replayed
