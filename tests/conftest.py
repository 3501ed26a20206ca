from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

# Every process of the real jobs the tests start imports torch (agent and ranks: about 80 jobs
# of three each), and torch scans every installed distribution's entry points for device
# backends at import: none is installed here, and the scan is about an eighth of the import.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

FIXTURES = Path(__file__).parent / "fixtures"
PROC_TORCHRUN = FIXTURES / "proc-torchrun"
# The capture in fixtures/proc-torchrun: a real `torchrun --standalone --nproc-per-node=2`
# job of tests/workloads/rank.py, each rank with two forked workers.
AGENT, RANK0, RANK1 = 3277, 3282, 3283
RANK0_WORKERS, RANK1_WORKERS = (3291, 3293), (3290, 3292)
SHELL, KTHREADD = 1110, 2
RUN_ID = "8d6de2d1-f2bf-4ce7-91d2-e43f34b89cbc"


@pytest.fixture
def proc_tree(tmp_path: Path) -> Path:
    """A writable copy of the captured /proc tree (tests edit it to simulate changes)."""
    dst = tmp_path / "proc"
    shutil.copytree(PROC_TORCHRUN, dst)
    return dst


def is_root() -> bool:
    return os.geteuid() == 0


@pytest.fixture(autouse=True)
def _keep_postmortems(request: pytest.FixtureRequest) -> Any:
    """With TRAINWATCH_KEEP_POSTMORTEMS=DIR, every postmortem a test's daemon or `run`
    wrote under its tmp_path is copied to DIR/<test>/ after the test: the material
    scripts/compare-postmortems compares between two versions of the code."""
    yield
    dest = os.environ.get("TRAINWATCH_KEEP_POSTMORTEMS")
    args = request.node.funcargs if hasattr(request.node, "funcargs") else {}
    # the test's own tmp_path, and the folder of a death a module's fixture made once for
    # all its tests (tests/e2e/scenarios/): a value with a tmp_path of its own
    tmps = [args["tmp_path"]] if "tmp_path" in args else []
    tmps += [v.tmp_path for v in args.values() if isinstance(getattr(v, "tmp_path", None), Path)]
    if not dest or not tmps:
        return
    folder = Path(dest) / re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)
    for path in (p for tmp in tmps for p in Path(tmp).rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("schema") == "trainwatch.postmortem/v1":
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, folder / path.name)


# -- one real death per scenario --------------------------------------------------------
# tests/e2e/scenarios/: a module per real death, whose fixture (scope="module") makes the
# death once and whose tests each read one view of it. Under xdist each such module goes to
# one worker whole, so the death is made once; every other test is scheduled as xdist's
# default (`load`) does. (xdist's own grouping, --dist loadgroup with xdist_group marks,
# groups nothing on pytest 9.2: pytest-xdist issue 1386.)
SCENARIOS = "tests/e2e/scenarios/"


def _scenario(nodeid: str) -> str | None:
    """The scenario module a test belongs to, None for any other test."""
    module = nodeid.split("::", 1)[0]
    return module if module.startswith(SCENARIOS) else None


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "load":
        return None  # another distribution asked for: xdist's own
    from xdist.scheduler import LoadScheduling

    if not callable(getattr(LoadScheduling, "_send_tests", None)):
        # xdist's internals moved: its own scheduling (a scenario's death is then made once
        # per worker that runs one of its tests: slower, as right)
        return None

    class WholeScenarios(LoadScheduling):  # type: ignore[misc]
        def _send_tests(self, node: Any, num: int) -> None:
            """xdist's, but a batch that takes a scenario's test takes the rest of its
            module too (a module's tests are consecutive in the collection)."""
            pending, collection = getattr(self, "pending", None), getattr(self, "collection", None)
            if not isinstance(pending, list) or collection is None:
                return super()._send_tests(node, num)  # type: ignore[no-any-return]
            modules = {_scenario(collection[i]) for i in pending[:num]} - {None}
            while num < len(pending) and _scenario(collection[pending[num]]) in modules:
                num += 1
            super()._send_tests(node, num)

    return WholeScenarios(config, log)


# -- what the suite left out ------------------------------------------------------------
# tests/support/skips.py holds the table of preconditions; here every skip and every left-out check
# is listed at the end, and under TRAINWATCH_STRICT_SKIPS=1 one whose key is not allowed
# (tests/allowed-skips.txt) fails the session.

_SKIPPED: list[tuple[str, str]] = []  # (test id, reason)
_LEFT_OUT: list[tuple[str, str, str]] = []  # (key, test id, what), from every worker's reports
_KEY = re.compile(r"^(?:Skipped: )?\[([a-z0-9-]+)\]")
_LEFT_OUT_PROPERTY = "trainwatch_left_out"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A check left out is recorded where the test ran (tests.support.skips.LEFT_OUT, in an xdist
    worker's memory): carry it on the test's report, which reaches the controller."""
    from tests.support import skips

    outcome = yield
    report = outcome.get_result()
    while skips.LEFT_OUT:
        report.user_properties.append((_LEFT_OUT_PROPERTY, list(skips.LEFT_OUT.pop(0))))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        _SKIPPED.append((report.nodeid, str(report.longrepr[2])))
    for name, value in report.user_properties:
        if name == _LEFT_OUT_PROPERTY:
            key, test, what = value
            _LEFT_OUT.append((str(key), str(test), str(what)))


def _unexpected() -> tuple[list[str], list[str]]:
    from tests.support import skips

    allowed = skips.allowed()
    lines, bad = [], []
    for nodeid, why in _SKIPPED:
        m = _KEY.match(why)
        key = m.group(1) if m else None
        line = f"skipped  {nodeid}: {why.removeprefix('Skipped: ')}"
        lines.append(line)
        if key not in allowed:
            bad.append(line)
    for key, nodeid, what in _LEFT_OUT:
        line = f"left out  {nodeid}: [{key}] {what}"
        lines.append(line)
        if key not in allowed:
            bad.append(line)
    return lines, bad


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    lines, bad = _unexpected()
    if not lines:
        terminalreporter.write_line("trainwatch: nothing was skipped or left out", green=True)
        return
    strict = os.environ.get("TRAINWATCH_STRICT_SKIPS") == "1"
    terminalreporter.section("what this machine left out", sep="=", yellow=True, bold=True)
    for line in lines:
        terminalreporter.write_line(line)
    if bad:
        terminalreporter.write_line(
            f"{len(bad)} of these are not allowed by tests/allowed-skips.txt"
            + (": this run FAILS (TRAINWATCH_STRICT_SKIPS=1)" if strict else " (a CI run would fail)"),
            red=True,
            bold=True,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller judges, from every worker's reports
    from tests.support import slurm

    slurm.stop()  # the test Slurm, if a test started it (every worker has ended by now)
    if os.environ.get("TRAINWATCH_STRICT_SKIPS") == "1" and _unexpected()[1] and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker, say so to this process only (tests/support/e2e.py scopes its daemons by
    it): PYTEST_XDIST_WORKER alone is inherited by every child, a nested pytest's included."""
    if hasattr(config, "workerinput"):
        os.environ["TRAINWATCH_XDIST_PID"] = str(os.getpid())
