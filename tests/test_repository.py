"""The repository keeps its promises about itself: the figures of the README and docs/ are the
results files' (benchmarks/render.py), the diagnose example is the command's output, the
README's postmortem is lines of a real one, the README stays a front page whose links resolve,
nothing reads beside the clone, and a skip the allow-list does not name fails a strict run."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.e2e import REPO

ELISION = "..."  # a line of its own in the README's excerpt: lines were cut here


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _fenced_blocks(text: str) -> list[tuple[int, str]]:
    """Each fenced block of a Markdown text: (the line its fence opens on, its body)."""
    blocks, lines, i = [], text.splitlines(keepends=True), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((start, "".join(body)))
        i += 1
    return blocks


def test_the_documented_figures_are_rendered_from_the_results_files():
    r = subprocess.run(
        [sys.executable, "benchmarks/render.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr


def test_the_docs_show_what_diagnose_prints_for_the_opening_story():
    """docs/diagnose.md's example is the command's output, not a copy that drifts from it. The
    story's logs stamp local time without a zone (dmesg -T, glog), which diagnose reads as
    this machine's: the page shows them read on a node in UTC, so the command runs so."""
    story = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "tests/fixtures/diagnose/opening-story").iterdir()
    )
    r = subprocess.run(
        [sys.executable, "-m", "sidecar", "diagnose", *story],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, TZ="UTC0"),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("trainwatch postmortem ") and len(r.stdout.splitlines()) > 10, r.stdout
    page = (REPO / "docs/diagnose.md").read_text()
    assert f"```\n{r.stdout}```\n" in page, "docs/diagnose.md's diagnose example is stale:\n" + r.stdout


def _postmortems(text: str) -> list[str]:
    """The fenced blocks of a page that are a postmortem's text view."""
    return [body for _, body in _fenced_blocks(text) if body.startswith("trainwatch postmortem ")]


def test_the_readme_postmortem_is_lines_of_the_real_one():
    """The README opens with an excerpt of the real postmortem that docs/verdicts.md keeps
    whole (`trainwatch demo`'s): each run of lines between two elision lines is a run of
    consecutive lines of it, the runs in its order, so the excerpt cannot drift into
    invented text."""
    excerpts = _postmortems((REPO / "README.md").read_text())
    wholes = _postmortems((REPO / "docs/verdicts.md").read_text())
    assert len(excerpts) == 1, "the README shows one postmortem excerpt"
    assert len(wholes) == 1, "docs/verdicts.md keeps the whole postmortem"
    excerpt, whole = excerpts[0].splitlines(), wholes[0].splitlines()
    assert ELISION not in (line.strip() for line in whole), "the whole one has no elision line"
    assert ELISION in (line.strip() for line in excerpt), "an excerpt marks its cuts"
    assert excerpt[0] == whole[0], "the excerpt starts where the postmortem does"
    runs: list[list[str]] = [[]]
    for line in excerpt:
        if line.strip() == ELISION:
            runs.append([])
        else:
            runs[-1].append(line)
    at = 0
    for run in filter(None, runs):
        found = next(
            (i for i in range(at, len(whole) - len(run) + 1) if whole[i : i + len(run)] == run), None
        )
        shown = "\n".join(run)
        assert found is not None, f"not consecutive lines of the real postmortem, in its order:\n{shown}"
        at = found + len(run)
    kept = sum(map(len, runs))
    assert 8 <= kept < len(whole), kept


def test_the_readme_is_a_front_page_that_opens_with_a_postmortem():
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the rest to docs/"
    assert lines[0] == "# trainwatch"
    first_block = _fenced_blocks(text)[0][0]
    first_section = next(i for i, line in enumerate(lines) if line.startswith("## "))
    assert first_block < first_section, "the postmortem comes before the first section"
    assert _fenced_blocks(text)[0][1].startswith("trainwatch postmortem ")
    prose = lines[1:first_block]
    assert sum(line.count(". ") + line.rstrip().endswith(".") for line in prose) == 1, (
        "one sentence before the postmortem"
    )


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """Every relative link in README.md and docs/*.md names a file or folder of the
    repository (an anchor is not checked); links inside code are not links."""
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        links = LINK.findall(text)
        assert page.name != "README.md" or len(links) > 10, links  # the pattern finds links
        for target in links:
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor of the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_nothing_reads_beside_the_clone():
    offenders = []
    for folder in ("sidecar", "tests", "benchmarks", "scripts", ".ci"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh") and path.name != Path(__file__).name:
                text = path.read_text(errors="replace")
                if re.search(r"\.\./shared|parents\[2\] / \"shared\"", text):
                    offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


def _strict_run(tmp_path: Path, body: str, *extra: str) -> subprocess.CompletedProcess[str]:
    probe = tmp_path / "test_probe.py"
    probe.write_text("from tests.support.skips import left_out, skip\nimport pytest\n\n" + body)
    env = dict(os.environ, TRAINWATCH_STRICT_SKIPS="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            *extra,
            str(probe),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_skip_the_allow_list_does_not_name_fails_a_strict_run(tmp_path):
    r = _strict_run(tmp_path, "def test_x():\n    skip('chromium')\n")
    assert r.returncode == 1, r.stdout
    assert "left out" in r.stdout or "skipped" in r.stdout
    assert "not allowed by tests/allowed-skips.txt" in r.stdout, r.stdout


def test_a_check_left_out_inside_a_passing_test_fails_a_strict_run(tmp_path):
    r = _strict_run(tmp_path, "def test_x():\n    left_out('tracefs', 'the sender')\n")
    assert r.returncode == 1 and "left out" in r.stdout, r.stdout


def test_a_check_left_out_in_a_worker_fails_a_strict_run_side_by_side(tmp_path):
    """Under pytest-xdist (make test's steps) a check left out in a worker reaches the
    controller on the test's report and still fails the strict run."""
    body = "def test_x():\n    left_out('tracefs', 'the sender')\n\ndef test_y():\n    pass\n"
    r = _strict_run(tmp_path, body, "-n", "2")
    assert r.returncode == 1 and "left out" in r.stdout and "[tracefs]" in r.stdout, r.stdout


def test_an_allowed_skip_passes_a_strict_run(tmp_path):
    r = _strict_run(tmp_path, "def test_x():\n    skip('gpu')\n\ndef test_y():\n    pass\n")
    assert r.returncode == 0, r.stdout
    assert "[gpu]" in r.stdout


def _imports(tree: ast.Module, typing: bool = True) -> set[str]:
    """Every ``sidecar`` module a file imports, at module level or inside a function (a lazy
    import is still a dependency), and under ``if TYPE_CHECKING:`` unless ``typing`` is
    False (a type a room names is knowledge it has, though no import cycle at run time)."""
    skip = {
        id(n)
        for node in ast.walk(tree)
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for n in ast.walk(child)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sidecar"):
            out |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("sidecar")}
    return out


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (REPO / "sidecar").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _room(module: str) -> str:
    """sidecar.deaths.hear -> deaths; sidecar.model -> model."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


# The floors of docs/architecture.md: each ground-floor room and the only rooms it may use.
# (The flows above them, sampling and deaths, are held by the rules of the next test.)
GROUND = {
    "probes": {"model", "errors", "parse", "saferead"},
    "watch": {"model", "errors", "parse", "probes"},
    "parse": {"model", "catalog"},
    "catalog": {"model"},
    "autopsy": {"model", "parse", "catalog", "trend", "units"},
    "postmortem": {"model", "autopsy", "redact", "units"},
    "trend": set(),
    "units": set(),
    "lognames": set(),
    "model": set(),
    "errors": set(),
    "redact": set(),
    "protection": set(),
}


def test_each_floor_uses_only_the_floors_below_it():
    """The picture in docs/architecture.md, kept true (imports for type checking count): the
    ground floor (probes, watch, parse, autopsy, postmortem, ...) never reaches up into the
    live rooms or the verdicts; the flows take their events from the model; the sampling
    flow never imports the death flow; the death flow reads of the sampling flow only the
    history it keeps (timeline); nothing below the daemon imports it, the server or the CLI."""
    mods = _modules()
    edges: set[tuple[str, str, str]] = set()  # (module, its room, a room it imports)
    for name, path in mods.items():
        for dep in _imports(ast.parse(path.read_text())):
            if dep in mods and dep != "sidecar" and _room(dep) != _room(name):
                edges.add((name, _room(name), dep))
    assert len(edges) > 60  # the walk found the package
    wrong = []
    for name, room, dep in sorted(edges):
        there = _room(dep)
        if room in GROUND and there not in GROUND[room]:
            wrong.append(f"{name} -> {dep}: {room} may use only {sorted(GROUND[room])}")
        if name in {"sidecar.deaths.hear", "sidecar.deaths.engine"} and there == "probes":
            wrong.append(f"{name} -> {dep}: the feeds only record; the Gatherer is the one door to files")
        if room in {"sampling", "deaths"} and there == "watch":
            wrong.append(f"{name} -> {dep}: the flows hear events in the model's words (model/events.py)")
        if room == "sampling" and there in {"deaths", "autopsy", "postmortem", "diagnose", "story"}:
            wrong.append(f"{name} -> {dep}: sampling never imports the death flow or its verdicts")
        if room == "deaths" and there == "sampling" and dep != "sidecar.sampling.timeline":
            wrong.append(f"{name} -> {dep}: the death flow reads only the history sampling keeps")
        if room == "sampling" and there == "stalls":
            wrong.append(f"{name} -> {dep}: sampling reads; the stalls wing asks the ranks (py-spy, FIFOs)")
        if room == "web" and there == "front":
            wrong.append(f"{name} -> {dep}: the web serves what it is handed; the front starts it")
        if there in {"daemon", "web", "front"} and room not in {"daemon", "web", "front", "__main__"}:
            wrong.append(f"{name} -> {dep}: nothing below the daemon imports it, the web or the front")
    assert not wrong, wrong


def test_only_the_stalls_wing_and_the_front_start_a_process():
    """The sampling flow and the death flow read: no module of theirs, nor of the ground floor,
    imports ``subprocess`` or calls a fork or an exec. py-spy (the stalls wing), ``trainwatch
    run`` and the demo (the front) start processes; so do two checks at the daemon's start, a
    child that exits at once each: whether this kernel keeps a zombie's exit status, and
    whether the process connector's filter lets a failing exit through."""
    starters = []
    for path in sorted((REPO / "sidecar").rglob("*.py")):
        room = _room(".".join(path.relative_to(REPO).with_suffix("").parts))
        text = path.read_text()
        tree = ast.parse(text)
        spawns = "subprocess" in {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }
        spawns |= bool(re.search(r"\bos\.(fork|exec\w*|spawn\w*|posix_spawn\w*|system|popen)\(", text))
        if spawns:
            starters.append((room, path.relative_to(REPO).as_posix()))
    assert starters, "the walk finds the modules that start processes"
    others = {path for room, path in starters if room not in {"stalls", "front"}}
    assert others <= {"sidecar/probes/zombies.py", "sidecar/watch/exits.py"}, others


def test_the_package_has_no_import_cycle():
    """Imports go one way (docs/architecture.md): no module reaches itself through others."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = {d for d in _imports(ast.parse(path.read_text()), typing=False) if d in mods}
        # a package's own __init__ re-exports its rooms: not an edge back from them
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    assert len(graph) > 40 and sum(map(len, graph.values())) > 60  # the walk found the package

    cycles = []

    def visit(node: str, path: list[str], done: set[str]) -> None:
        for dep in sorted(graph[node]):
            if dep in path:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in done:
                visit(dep, [*path, dep], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name], done)
    assert not cycles, cycles[:5]


def test_no_module_of_the_package_is_over_500_lines():
    """Each room one job, read in one sitting (issue 30): a module that grows past 500 lines
    has taken a second job; split it by job."""
    long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / "sidecar").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, long


def test_no_rule_function_is_over_120_lines():
    """A rule of the autopsy, diagnose or the death flow is read in one sitting: 120 lines
    at most. A cascade is an ordered tuple of small rules (``_KILLERS``, ``_OWN_WORDS``,
    ``_LOG_RULES``), not one long function."""
    long = []
    for room in ("autopsy", "diagnose", "deaths"):
        for path in sorted((REPO / "sidecar" / room).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                if function and (node.end_lineno or node.lineno) - node.lineno + 1 > 120:
                    long.append(f"{path.relative_to(REPO)}:{node.name}")
    assert not long, long


def test_the_tests_are_laid_out_by_what_they_test():
    """tests/unit/ROOM/ holds the fast tests of one room of sidecar/ (ground/ for its
    top-level modules, deploy/ for deploy/ and dashboards/), tests/e2e/ the tests of real
    jobs and deaths (its conftest marks them slow, no file does), tests/support/ what they
    share: no test module imports another, and no folder is named after a room that is gone."""
    rooms = {p.name for p in (REPO / "sidecar").iterdir() if (p / "__init__.py").exists()}
    tests = REPO / "tests"
    files = sorted(tests.rglob("test_*.py"))
    assert len(files) > 60, "the walk finds the tests"
    wrong = []
    for path in files:
        where = path.relative_to(tests).parts
        if where == ("test_repository.py",) or where[0] == "fixtures":
            continue
        if where[0] == "unit" and len(where) == 3 and where[1] not in rooms | {"ground", "deploy"}:
            wrong.append(f"{path.relative_to(REPO)}: no room sidecar/{where[1]}/")
        elif where[0] not in ("unit", "e2e"):
            wrong.append(f"{path.relative_to(REPO)}: outside tests/unit/ and tests/e2e/")
        text = path.read_text()
        if re.search(r"pytest\.mark\.slow\b", text):
            wrong.append(f"{path.relative_to(REPO)}: marks slow itself (tests/e2e/conftest.py does)")
        for dep in _imports_of_tests(ast.parse(text)):
            if re.match(r"tests\.(unit|e2e)\.", dep) or re.match(r"tests\.test_", dep):
                wrong.append(f"{path.relative_to(REPO)} imports {dep}: share it through tests/support/")
    assert not wrong, wrong


def _imports_of_tests(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tests")}
    return out
