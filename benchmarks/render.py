"""Render the measured figures of the README and the docs pages from the results files, so
they cannot drift.

    python benchmarks/render.py          # rewrite the generated parts of README.md and docs/*.md
    python benchmarks/render.py --check  # exit 1 if any of them differs from its rendering

Each generated part sits between ``<!-- generated: NAME -->`` and
``<!-- end generated: NAME -->`` in README.md or one of the pages in docs/ (most are in
docs/performance.md; the others beside the text they measure: docs/diagnose.md,
docs/foresight.md, docs/story.md, docs/web-config.md). NAME picks the renderer below and
the renderer reads ``benchmarks/results/*.json`` (written by ``make bench`` and, for the
GPU figures, ``make bench-gpu`` on a machine with an NVIDIA GPU). Each renderer's block
appears exactly once across those files: a missing or repeated one is an error that names
it. A block whose NAME is no renderer's is left as it is (a page generated elsewhere may use
the same markers). The test suite runs the check.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
DOCS = REPO / "docs"
MIB = 1 << 20
GIB = 1 << 30


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return dict(json.loads(path.read_text())) if path.exists() else None


def _provenance(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    return (
        f"{m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / GIB:.0f} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}; {doc['date'][:10]}, commit `{doc['commit']}`"
    )


def _missing(name: str, how: str) -> str:
    return f"No results yet (`benchmarks/results/{name}.json`): {how}.\n"


def _us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} µs"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} %"


def overhead() -> str:
    doc = _load("overhead")
    if doc is None:
        return _missing("overhead", "run `make bench`")
    r = doc["results"]
    out = [
        f"`benchmarks/overhead.py` ({_provenance(doc)}; process-exporter: {r['exporter'] or 'absent'}"
        + (", quick run" if r["quick"] else "")
        + "). The whole daemon process (the CPU time of all its threads, HTTP scrapes every 15 s"
        " included) per watched process per sampling round, and its share of one core; beside it,"
        " `prometheus-process-exporter` on the same processes, scraped at the same rate (one"
        " scrape is one round), in the same run:",
        "",
        "| processes (agents × ranks × (1 + workers)) | trainwatch, 1 Hz | process-exporter, 1 Hz "
        "| trainwatch, 10 Hz | process-exporter, 10 Hz | `/metrics` p50 / p99 | sampler alone, median (min) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lagged = False
    for row in r["rows"]:
        cells = [
            f"{row['processes']} ({row['agents']} × {row['ranks'] // row['agents']} × (1 + {row['workers_per_rank']}))"
        ]
        for rate in ("1hz", "10hz"):
            m = row[rate]
            cells.append(
                f"{_us(m['trainwatch_us_per_process_round'])} ({_pct(m['trainwatch_core_percent'])})"
            )
            wanted = m["window_seconds"] / m["interval_seconds"]
            behind = m["exporter_scrapes"] is not None and m["exporter_scrapes"] < 0.9 * wanted
            lagged |= behind
            cells.append(
                f"{_us(m['exporter_us_per_process_scrape'])} ({_pct(m['exporter_core_percent'])})"
                + (f" † {m['exporter_scrapes'] / m['window_seconds']:.1f}/s" if behind else "")
            )
        fresh = row.get("metrics_fresh_p50_ms")
        cells.append(
            f"{row['metrics_p50_ms']:.2f} / {row['metrics_p99_ms']:.2f} ms"
            + (
                f"; first of a round {fresh:.2f} / {row['metrics_fresh_max_ms']:.2f} ms"
                if fresh is not None
                else ""
            )
        )
        cells.append(
            f"{_us(row['sampler_only_us_per_process_round'])} ({_us(row['sampler_only_us_per_process_round_min'])})"
        )
        out.append("| " + " | ".join(cells) + " |")
    idle, soak, churn = r["idle"], r["soak"], r.get("churn")
    floors = [row for row in r["rows"] if "floor_reads_core_percent" in row["1hz"]]
    if floors:
        out += [
            "",
            "The floor under it, measured beside it in the same windows (`benchmarks/floor.py`): a"
            " Python thread that only wakes at the interval, and one that also reads, through held"
            " descriptors and without parsing, the files the daemon reads on its schedule (once a"
            " second each rank's stat and status, each worker's statm, the cgroup's counters, the"
            " host's files; between, the ranks' and workers' statm and the cgroup's usage). Share of"
            " one core; these machines are noisy, and the wake-alone column shows how much the"
            " windows differ:",
            "",
            "| processes | trainwatch, 1 Hz | reads alone, 1 Hz | wake alone, 1 Hz | trainwatch, 10 Hz "
            "| reads alone, 10 Hz | wake alone, 10 Hz |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in floors:
            cells = [str(row["processes"])]
            for rate in ("1hz", "10hz"):
                m = row[rate]
                cells += [
                    f"{m[key]:.3f} %" if m.get(key) is not None else "n/a"
                    for key in (
                        "trainwatch_core_percent",
                        "floor_reads_core_percent",
                        "floor_wake_core_percent",
                    )
                ]
            out.append("| " + " | ".join(cells) + " |")
    if lagged:
        out += [
            "",
            "† process-exporter could not keep up: each scrape took longer than the interval, so it"
            " was scraped back to back, at the rate shown; its cost per scrape is still per scrape.",
        ]
    out += [
        "",
        "`/metrics`: p50 / p99 of 200 scrapes back to back (a body is rendered once a round), and"
        " p50 / max of 20 scrapes each the first of its round (rendered for it).",
        "",
        "In brackets: the share of one core. The last column is `Sampler.sample()` alone in the"
        " benchmark's process (no HTTP, no threads, no death watchers): what one sampling round"
        " costs, not what the daemon costs.",
        "",
        f"- The daemon with no job to watch, at 1 Hz: **{idle['core_percent']:.3f} % of one core**"
        f" over {idle['seconds']:.0f} s.",
        *(
            [
                f"- With {churn['processes_per_second']:,} short-lived failing processes a second on the"
                " node (a shell loop running `/bin/false`), watching a job of 2 ranks at 1 Hz:"
                f" **{churn['core_percent']:.2f} % of one core** over {churn['seconds']:.0f} s."
            ]
            if churn
            else []
        ),
        f"- Its RSS over {soak['rounds']} rounds at 10 Hz with `--history 60` (600 points of history a"
        f" job, as the default 600 s at 1 Hz), 8 ranks × 8 workers watched:"
        f" **{soak['rss_start_bytes'] / MIB:.1f} MiB -> {soak['rss_end_bytes'] / MIB:.1f} MiB**.",
    ]
    return "\n".join(out) + "\n"


AB_CHANGES = (  # results name, what changed (the commits are in each file)
    ("overhead-ab-noise", "nothing: the same commit on both sides (the noise floor)"),
    ("overhead-ab-http", "the HTTP server and the main thread stop ticking"),
    (
        "overhead-ab-events",
        "jobs found from the connector's events, filtered in the kernel; an idle daemon sleeps",
    ),
    ("overhead-ab-detail", "each file at the rate it matters; descriptors held open"),
    (
        "overhead-ab-round",
        "records copied without re-running __init__; descendants from statm; /metrics cached",
    ),
    ("overhead-ab-judge", "foresight and stalls judge once a second; the journal without a deep copy"),
    (
        "overhead-ab-reads",
        "host and cgroup files held open; the journal written in place; a rank's trend judged only"
        " while its limit grows; light rounds read a rank's statm; the death watch tidies once a"
        " second (this session's changes together, beside the last commit of the one before)",
    ),
    (
        "overhead-ab-exec",
        "issue 39, tried and reverted: every exec passes the connector's filter (a launcher found at"
        " its exec)",
    ),
    (
        "overhead-ab-rescan",
        "issue 39: /proc listed every second, a daemon with no job rounds every second (a launcher"
        " found by its command line)",
    ),
    ("overhead-ab-rescan-1x8x8", "the same, on a job of 73 processes"),
    (
        "overhead-ab-launchers",
        "issue 39: every launcher (spawn's and Lightning's children, MPI, Slurm), stranded survivors"
        " (this session's changes together, beside the last commit of the one before)",
    ),
    ("overhead-ab-launchers-1x8x8", "the same, on a job of 73 processes"),
)


def overhead_ab() -> str:
    """Each change's before and after: the daemon of the change's commit beside the one of
    the commit before it, in the same run (``overhead.py --baseline``)."""
    rows = []
    for name, what in AB_CHANGES:
        doc = _load(name)
        if doc is None:
            continue
        r = doc["results"]
        row = next((row for row in r["rows"] if row["processes"] == 21), r["rows"][0])
        cells = [what, f"`{doc['commit']}` vs `{r['baseline']}`", str(row["processes"])]
        for rate in ("1hz", "10hz"):
            m = row[rate]
            cells.append(
                f"{_us(m['trainwatch_us_per_process_round'])} / {_us(m.get('baseline_us_per_process_round'))}"
            )
        idle = r["idle"]
        cells.append(f"{idle['core_percent']:.3f} / {idle['baseline_core_percent']:.3f} %")
        churn = r.get("churn")
        cells.append(
            f"{churn['core_percent']:.2f} / {churn['baseline_core_percent']:.2f} % "
            f"({churn['processes_per_second']:,}/s)"
            if churn
            else "n/a"
        )
        rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return _missing("overhead-ab-*", "run `benchmarks/overhead.py --baseline REV`")
    first = _load(AB_CHANGES[0][0]) or {}
    return (
        "\n".join(
            [
                "Each change beside the commit before it, in the same run, on the same processes (those"
                " of issue 18: 1 agent × 4 ranks × (1 + 4 workers) = 21; later rows say how many are"
                f" watched; {_provenance(first)} for the first row, each file has its own). Per watched"
                " process per round, after / before; idle and"
                " churn in share of one core. `+dirty`: that commit's daemon measured by the newest"
                " benchmark script (schedstat CPU time, the churn row). The noise floor's row predates"
                " it and counts 10 ms ticks: its 1 Hz and idle figures are coarse.",
                "",
                "| change | commits | watched | 1 Hz | 10 Hz | idle | churn |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
                *rows,
            ]
        )
        + "\n"
    )


def deaths() -> str:
    doc = _load("deaths")
    if doc is None:
        return _missing("deaths", "run `make bench`")
    r = doc["results"]
    limit = (
        f"a {r['cgroup_limit_bytes'] / GIB:g} GiB memory cgroup limit (cgroup_oom)"
        if r["cgroup_limit_bytes"]
        else "no memory cgroup (killed from outside)"
    )
    kinds = sorted({d["killer"] for d in r["per_death"]})
    out = [
        f"`benchmarks/deaths.py` ({_provenance(doc)}): {r['deaths']} real deaths of a rank growing"
        f" {r['grow_mib_per_20ms']} MiB every 20 ms against {limit}, sampled every"
        f" {r['interval_seconds']:g} s (10 Hz near the limit); verdicts: {', '.join(kinds)}"
        + (f"; sources turned off: {', '.join(r['disabled'])}" if r["disabled"] else "")
        + ".",
        "",
        f"- Death to postmortem: p50 **{r['latency_p50_ms']:.0f} ms**, p95 **{r['latency_p95_ms']:.0f} ms**,"
        f" max {r['latency_max_ms']:.0f} ms (the autopsy waits 0.25 s for the kernel's records).",
    ]
    if r["victim_rss_error_mean"] is not None:
        out.append(
            "- The victim's last sampled RSS against the kernel's OOM record at the kill (anon + file +"
            f" shmem RSS): mean {100 * r['victim_rss_error_mean']:+.1f} %, worst"
            f" {100 * r['victim_rss_error_worst']:+.1f} %."
        )
    if r["tree_rss_to_charge_mean"] is not None:
        mean = r["tree_rss_to_charge_mean"]
        agree = (
            f"here they agree within {100 * abs(mean - 1):.1f} % on average"
            if abs(mean - 1) < 0.05
            else f"here the tree RSS is {100 * (mean - 1):+.0f} % off the charge on average"
        )
        out.append(
            "- The ranks' tree RSS summed, against the cgroup's charge read in the same round:"
            f" {mean:.3f} of it on average ({r['tree_rss_to_charge_min']:.3f} to"
            f" {r['tree_rss_to_charge_max']:.3f}). RSS counts the pages that processes share (the torch"
            " libraries every rank maps, forked workers' pages) once per process; the charge counts each"
            f" page once and adds the agent, page cache and kernel memory; {agree}. The charge is what"
            " the kernel enforces; the tree RSS says which rank holds what."
        )
    return "\n".join(out) + "\n"


def _share(right: int, of: int) -> str:
    return f"{100 * right / of:.0f} %" if of else "-"


def diagnose() -> str:
    doc = _load("diagnose")
    if doc is None:
        return _missing("diagnose", "run `make bench`")
    r = doc["results"]
    if "halves" not in r:
        return _missing(
            "diagnose", "run `python benchmarks/diagnose_accuracy.py` (the results predate the split)"
        )
    dev, held = r["halves"]["dev"], r["halves"]["held_out"]
    out = [
        f"On the {r['cases']} real incidents of `{r['cases_file']}` (public issue threads, each with its URL, torch"
        f" version and launcher; `python benchmarks/diagnose_accuracy.py`, {doc['date'][:10]}, commit"
        f" `{doc['commit']}`), split by a fixed hash of each thread's URL into a half that may be read while"
        " writing rules (`dev`) and a half that is only scored (`held_out`; tests/support/corpus.py):",
        "",
        "| half | cases | right | decisive cases | decisive right | wrong given as `certain`/`likely` |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, h in (("dev", dev), ("held_out", held)):
        out.append(
            f"| {name} | {h['cases']} | {h['right']} | {h['decisive']} |"
            f" {h['decisive_right']} ({_share(h['decisive_right'], h['decisive'])}) | {h['confident_wrong']} |"
        )
    # the outside collections (tests/fixtures/public-logs/cases-waveN.jsonl), scored apart
    rows: list[tuple[dict[str, Any], str, str]] = [
        (
            r["halves"],
            "held_out_unseen",
            "held_out, collected after the split (no case text read while writing rules)",
        )
    ]
    for wave, when in (
        (4, "after the fourth wave's families"),
        (5, "after the wrap and family fixes"),
        (6, "after the fifth collection was scored"),
        (7, "after the sixth collection's rules"),
        (8, "after the seventh collection's rules"),
        (9, "after the eighth collection's rules"),
        (10, "after the ninth collection's rules"),
        (11, "after the tenth collection's rules"),
        (12, "after the eleventh collection's rules"),
        (13, "after the twelfth collection's rules"),
        (14, "after the thirteenth collection's rules"),
        (15, "after the fourteenth collection's rules"),
        (16, "after the fifteenth collection (leaning to other libraries' GPU failures)"),
        (17, "after the sixteenth collection's rules"),
        (18, "after submitit's and Ray's node words (representative)"),
        (19, "beside the eighteenth (leaning to other frameworks' GPU failures and schedulers)"),
        (20, "after the nineteenth's rules (half other frameworks, half PyTorch)"),
        (21, "after the twentieth's rules (representative)"),
        (22, "beside the twenty-first (leaning to other frameworks and outside signals)"),
        (23, "after the twenty-second's rules (memory killers; excerpts unconfirmed)"),
        (24, "beside the twenty-third (other frameworks only; excerpts unconfirmed)"),
        (25, "after the cgroup-counter and paste fixes (representative)"),
        (26, "beside the twenty-fifth (launchers other than torchrun)"),
        (27, "after the twenty-sixth's rules (PyTorch, other libraries' words)"),
        (28, "beside the twenty-seventh (frameworks other than PyTorch)"),
        (29, "after the twenty-eighth's rules (hangs and timeouts, other frameworks' GPU memory)"),
        (30, "beside the twenty-ninth (representative, 2025-2026)"),
        (31, "beside the thirtieth's rules (other frameworks, JAX, store and gloo timeouts)"),
        (32, "after the thirty-first's rules (representative, schedulers; search excerpts)"),
        (33, "after the tag, tiny-cuda-nn and Caffe2 fixes (issue 40's families, representative)"),
        (34, "after the Iris and submitit entries (representative)"),
        (35, "after the advice mend, a representative mix of 2024-2026"),
        (36, "after the vLLM, coordination-service and cut-OOM rules (two collectors)"),
    ):
        doc_n = _load(f"diagnose-wave{wave}")
        halves_n = doc_n["results"]["halves"] if doc_n else {}
        rows += [
            (halves_n, "collected_wave4", f"cases-wave{wave}.jsonl, collected {when} (both halves)"),
            (
                halves_n,
                "held_out_wave4",
                f"cases-wave{wave}.jsonl, held_out (no case text read while writing rules)",
            ),
        ]
    # every held-out half together: cases.jsonl's and each collection's (the issue's bar)
    helds = [r["halves"]["held_out"]] + [
        h["held_out_wave4"] for h, k, _ in rows if k == "held_out_wave4" and h
    ]
    total = {
        f: sum(h[f] for h in helds)
        for f in ("cases", "right", "decisive", "decisive_right", "confident_wrong")
    }
    rows.append(({"all": total}, "all", f"every held_out half together ({len(helds)} files)"))
    for halves, key, said in rows:
        unseen = halves.get(key)
        if unseen:
            out.append(
                f"| {said} | {unseen['cases']} |"
                f" {unseen['right']} | {unseen['decisive']} | {unseen['decisive_right']}"
                f" ({_share(unseen['decisive_right'], unseen['decisive'])}) | {unseen['confident_wrong']} |"
            )
    out += [
        "",
        "A decisive case is one whose excerpt holds the record that decides the label; on the others an"
        " honest `unknown` or `possible` answer is right to be unsure, and only a confident wrong answer"
        " counts against the tool.",
        "",
    ]
    for group, title in (("per_kind", "the thread supports"), ("per_launcher", "launcher")):
        keys = sorted(set(dev[group]) | set(held[group]))
        out += [
            f"| {title} | dev: right / cases | dev: decisive right | held out: right / cases |"
            " held out: decisive right |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for key in keys:
            d = dev[group].get(key, {"cases": 0, "right": 0, "decisive": 0, "decisive_right": 0})
            h = held[group].get(key, {"cases": 0, "right": 0, "decisive": 0, "decisive_right": 0})
            out.append(
                f"| {key} | {d['right']} / {d['cases']} | {d['decisive_right']} / {d['decisive']} |"
                f" {h['right']} / {h['cases']} | {h['decisive_right']} / {h['decisive']} |"
            )
        out.append("")
    out += [
        "<details><summary>Every case</summary>",
        "",
        "| case | half | launcher | the thread supports | trainwatch diagnose | |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        mark = "right" if row["right"] else ("**confidently wrong**" if row["confident_wrong"] else "miss")
        out.append(
            f"| [{row['id']}]({row['source']}) | {row['half']} | {row['launcher']} | {row['truth']}"
            f" ({row['label_confidence']}) | {row['answer']} ({row['confidence']}) | {mark} |"
        )
    out += ["", "</details>"]
    return "\n".join(out) + "\n"


def pastes() -> str:
    doc = _load("pastes")
    if doc is None:
        return _missing("pastes", "run `python benchmarks/paste_robustness.py`")
    r = doc["results"]
    per = r["per_perturbation"]
    out = [
        f"Every case of the corpus ({next(iter(per.values()))['cases']}, the {len(r.get('cases_files', [1]))}"
        f" files of `tests/fixtures/public-logs/`), each pasted {len(per)} ways"
        " (`python benchmarks/paste_robustness.py`, the perturbations in `tests/support/pastes.py`,"
        f" {doc['date'][:10]}, commit `{doc['commit']}`): a case changes when its kind or confidence"
        " differs from the case as collected, or its victim's rank where it had one.",
        "",
        "| pasted as | cases changed | became wrong | became right | became wrong with `certain`/`likely` |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, p in per.items():
        out.append(
            f"| {name} | {p['changed']} | {p['became_wrong']} | {p['became_right']} | "
            f"{p['became_confident_wrong']} |"
        )
    halves = sorted({row["half"] for p in per.values() for row in p["rows"]})
    out += [
        "",
        f"In all, {r['changed_total']} of {len(per) * next(iter(per.values()))['cases']} pasted cases changed"
        f" (halves: {', '.join(halves) or 'none'}), {r['confident_wrong_total']} of them to a confident wrong"
        " answer; `tests/unit/parse/test_pasted.py` holds every dev-half case of `cases.jsonl` to no change at all"
        " and its held-out half to no new confident-wrong answer.",
        "",
    ]
    return "\n".join(out)


def gpu() -> str:
    doc = _load("gpu")
    if doc is None:
        return _missing("gpu", "run `make bench-gpu` on a machine with an NVIDIA GPU")
    r = doc["results"]
    out = [
        f"On {r['device']} (`benchmarks/gpu_check.sh`, {_provenance(doc)}): two ranks of a real"
        " `torchrun` job each hold a known amount of CUDA memory; torch's own figures, trainwatch's"
        " `trainwatch_rank_gpu_memory_bytes` and `nvidia-smi --query-compute-apps`:",
        "",
        "| rank | torch `memory_allocated` | torch `memory_reserved` | trainwatch | nvidia-smi | trainwatch - reserved |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        tw, smi = row["trainwatch_bytes"], row["nvidia_smi_bytes"]
        diff = "n/a" if tw is None else f"{(tw - row['torch_reserved_bytes']) / MIB:.0f} MiB"
        out.append(
            f"| {row['rank']} | {row['torch_allocated_bytes']:,} | {row['torch_reserved_bytes']:,} |"
            f" {'n/a' if tw is None else f'{tw:,}'} | {'n/a' if smi is None else f'{smi:,}'} | {diff} |"
        )
    out += [
        "",
        "nvidia-smi prints MiB, so its column is that figure times 1 MiB; the difference to torch's"
        " reserved memory is each process's CUDA context and runtime.",
    ]
    return "\n".join(out) + "\n"


def steps() -> str:
    doc = _load("steps")
    if doc is None:
        return _missing("steps", "run `make bench-gpu` on a machine with an NVIDIA GPU")
    r = doc["results"]
    rows = r["rows"]
    world = rows[0]["world_size"]
    out = [
        f"A real training loop (`benchmarks/step_overhead.py`: a bf16 transformer, DDP over"
        f" {'NCCL' if rows[0]['cuda'] else 'gloo'}, {world} rank{'s' if world > 1 else ''} on"
        f" {r['device'] or 'CPU'}; {_provenance(doc)}), the daemon paused and resumed every"
        f" {r['phase_seconds']:g} s within one run so that each stretch is compared with its"
        " neighbour (separate runs differ by more than the effect on these machines):",
        "",
        "| daemon | pairs | median step paused / at work | step-time overhead, median of pairs [95 %] | daemon CPU |",
        "| --- | ---: | --- | --- | ---: |",
    ]
    for row in rows:
        lo, hi = row["overhead_pct_median_ci95"]
        out.append(
            f"| every {row['interval_seconds']:g} s | {row['pairs']} |"
            f" {row['median_step_off_s'] * 1e3:.2f} / {row['median_step_on_s'] * 1e3:.2f} ms |"
            f" {row['overhead_pct_median']:+.2f} % [{lo:+.2f} %, {hi:+.2f} %] | {row['daemon_cpu_s']:.2f} s |"
        )
    return "\n".join(out) + "\n"


def loaded() -> str:
    doc = _load("loaded-deaths")
    if doc is None:
        return _missing("loaded-deaths", "run `make bench` (as root)")
    r = doc["results"]
    names = {"cgroup": "cgroup OOM (1.5 GiB limit)", "global": "global OOM (the whole machine)"}
    out = [
        f"`benchmarks/loaded_deaths.py` ({_provenance(doc)}): {r['runs']} real OOM deaths of each kind"
        f" while {r['busy_processes']} processes spin on the CPU, watched by two daemons side by side:"
        " one as shipped, one with `--no-self-protection --oom-score-adj keep`. What the shipped one"
        f" was granted here: {'; '.join(r['grants'])}.",
        "",
        "| death | daemon | p50 | p95 | max |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind, row in r["kinds"].items():
        for name in ("protected", "unprotected"):
            s = row[name]
            out.append(
                f"| {names.get(kind, kind)} | {name} | {s['p50_ms']:.0f} ms | {s['p95_ms']:.0f} ms |"
                f" {s['max_ms']:.0f} ms |"
            )
    goals = {"global": 1000.0, "cgroup": 500.0}
    verdicts = []
    for kind, goal in goals.items():
        if kind in r["kinds"]:
            p95 = r["kinds"][kind]["protected"]["p95_ms"]
            slow = sum(1 for x in r["kinds"][kind]["protected_ms"] if x > goal)
            verdicts.append(
                f"{kind} p95 {'within' if p95 <= goal else 'over'} its {goal:g} ms goal"
                + (f" ({slow} of {len(r['kinds'][kind]['protected_ms'])} runs over it)" if slow else "")
            )
    out += ["", f"With {r['runs']} runs the p95 is the slowest run. As shipped: {'; '.join(verdicts)}."]
    return "\n".join(out) + "\n"


def fuzzing() -> str:
    doc = _load("fuzz")
    if doc is None:
        return _missing("fuzz", "run `make fuzz`")
    r = doc["results"]
    rows = r["rows"]
    worst = max(rows, key=lambda x: x["worst_ms_per_kib"])
    crashed = [x["target"] for x in rows if x["crashers"]]
    return (
        f"`make fuzz` ({_provenance(doc)}): {r['targets']} targets (every parser and input the daemon"
        f" reads), {r['inputs']} inputs ({r['examples_per_target']} per target, mutated from the"
        f" repository's real logs and /proc files): "
        + (
            f"**crashers in {', '.join(crashed)}**"
            if crashed
            else "**no exception outside a parser's contract**"
        )
        + f"; the slowest input, timed alone, took {worst['worst_ms_per_kib']:.3f} ms per KiB"
        f" ({worst['target']}; the limit is {r['limit_ms_per_kib']:g}). The CI suite runs the same targets"
        " on 150 inputs each and replays every crasher found so far"
        " (`tests/fixtures/fuzz-regressions/`).\n"
    )


def foresight() -> str:
    doc = _load("foresight")
    if doc is None:
        return _missing("foresight", "run `make bench` (as root)")
    r = doc["results"]
    names = {"cgroup": "cgroup OOM", "global": "global OOM"}

    def cell(at: dict[str, Any] | None) -> str:
        if at is None:
            return "(the leak lived less)"
        if at["predicted_s"] is None:
            return f"no prediction yet ({at['real_s']:.0f} s left)"
        return f"{at['predicted_s']:.1f} s for {at['real_s']:.1f} s ({at['error'] * 100:+.0f} %)"

    out = [
        f"`benchmarks/foresight.py` ({_provenance(doc)}): real torchrun jobs whose rank 1 leaks"
        f" anonymous memory until the kernel kills it, each watched by a fresh daemon sampling every"
        f" {r['interval_seconds']:g} s. At 30, 10 and 3 s before the kill (the kernel's kill record): the"
        " time left it predicted then (`/ranks`, polled 5 times a second) for the time that really was left.",
        "",
        "| death | leak (asked / measured) | leak lived | first warning before the kill | T-30 s | T-10 s | T-3 s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    within = total = 0
    rows = [(row, "") for row in r["leaks"]]
    v2 = _load("foresight-v2-h200")
    if v2 is not None:
        rows += [(row, " on cgroup v2 (the GPU machine)") for row in v2["results"]["leaks"]]
    for row, where in rows:
        warned = row["first_warning_lead_s"]
        out.append(
            f"| {names.get(row['kind'], row['kind'])}{where} ({row['killer']}, {row['confidence']}) |"
            f" {row['rate_mb_s']:g} / {row['measured_rate_mb_s']} MB/s | {row['life_s']:.0f} s |"
            f" {'none' if warned is None else f'{warned:.0f} s'} | "
            + " | ".join(cell(row["at"][str(lead)]) for lead in (30, 10, 3))
            + " |"
        )
        ten = row["at"].get("10")
        if ten is not None:
            total += 1
            within += ten["error"] is not None and abs(ten["error"]) <= 0.25
    quiet = r.get("quiet") or {}
    parts = []
    for name, what in (
        ("steady", "a steady job"),
        ("checkpoint", "a job that loads a 2 GiB checkpoint per rank once"),
    ):
        q = quiet.get(name)
        if q:
            parts.append(
                f"{what}: {q['warnings']} warnings, {q['episodes']} predictions"
                f" ({q['predicted_polls']} of {q['polls']} polls)"
            )
    out += [
        "",
        (f"The v2 row: {_provenance(v2)}. " if v2 is not None else "")
        + f"Within 25 % at 10 s before the kill (the goal): {within} of {total} runs."
        + (
            f" False alarms over {next(iter(quiet.values()))['seconds'] / 60:.0f} minutes, each job under a"
            f" 6 GiB cgroup limit: {'; '.join(parts)}."
            if parts
            else ""
        ),
    ]
    return "\n".join(out) + "\n"


def pss_cost() -> str:
    doc = _load("pss-cost")
    if doc is None:
        return _missing("pss-cost", "run `make bench`")
    r = doc["results"]
    return (
        f"`benchmarks/pss_cost.py` ({_provenance(doc)}): {r['processes']} processes (8 ranks of"
        f" {r['hold_mb_per_rank']} MiB, each with 7 forked workers mapping it: {r['tree_rss_bytes'] / GIB:.1f} GiB"
        f" of tree RSS, {r['tree_pss_bytes'] / GIB:.1f} GiB of PSS), two daemons side by side for"
        f" {r['window_seconds']:.0f} s: as shipped {r['core_share_with'] * 100:.2f} % of a core, with"
        f" `--disable smaps` {r['core_share_without'] * 100:.2f} %; the difference, what PSS and USS cost,"
        f" {r['core_share_difference'] * 100:+.2f} % (the daemon's own account of its smaps_rollup reads:"
        f" {r['smaps_core_share_own_account'] * 100:.2f} %; the budget is 1 %).\n"
    )


def story() -> str:
    doc = _load("story")
    if doc is None:
        return _missing("story", "run `python benchmarks/story_scale.py`")
    r = doc["results"]
    cli, http = r["cli_seconds"], r["http_seconds"]
    return (
        f"`benchmarks/story_scale.py` ({_provenance(doc)}): {r['nodes']} nodes, {r['ranks']} ranks, every"
        " node's daemon a real HTTP server serving the recorded real two-node run's postmortems, the"
        " Prometheus API answering with every node's deaths, ranks and clock samples, all on this"
        f" machine's {doc['machine']['cores']} cores beside the story; {r['repeat']} stories each way, a new"
        " job each (no cache):\n\n"
        "| how | median | slowest | goal |\n| --- | ---: | ---: | ---: |\n"
        f"| `trainwatch story` (the whole process, Python's start included) | {cli['median']:.2f} s |"
        f" {cli['max']:.2f} s | {r['goal_seconds']:g} s |\n"
        f"| `GET /story` on a daemon started with `--prometheus` | {http['median']:.2f} s | {http['max']:.2f} s"
        f" | {r['goal_seconds']:g} s |\n"
    )


def webauth() -> str:
    doc = _load("webauth-timing")
    if doc is None:
        return _missing("webauth-timing", "run `python benchmarks/webauth_timing.py --baseline REV`")
    r = doc["results"]
    rows = [("now", r)] + (
        [(f"before (`{r['baseline']['commit']}`)", r["baseline"])] if "baseline" in r else []
    )
    body = "".join(
        f"| {label} | {x['known_user_refused_ms']:.1f} ms | {x['unknown_user_refused_ms']:.1f} ms |"
        f" {x['ratio_unknown_to_known']:.2f} | {x['good_pair_remembered_ms']:.2f} ms |\n"
        for label, x in rows
    )
    return (
        f"`benchmarks/webauth_timing.py` ({_provenance(doc)}): a real daemon with two basic-auth users"
        f" (bcrypt cost {r['bcrypt_cost']}), {r['rounds']} refusals each way, sent in turns; medians:\n\n"
        "| daemon | known user, wrong password | unknown user | unknown / known | a good pair it remembers |\n"
        "| --- | ---: | ---: | ---: | ---: |\n" + body
    )


def gpu_stall() -> str:
    doc = _load("gpu-stall-h200")
    if doc is None:
        return _missing("gpu-stall-h200", "run `benchmarks/gpu_stall.py` on a GPU machine, then `--results`")
    r = doc["results"]
    rows = [
        "| phase | rank | NVML SM busy, mean (min) | memory busy, mean | CPU | daemon's polls stalled |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {"big": "bf16 matmuls, 64 MiB all_reduce", "small": "a small MLP's steps", "hang": "the hang"}
    for name, ph in r["phases"].items():
        for rank, x in ph["ranks"].items():
            rows.append(
                f"| {names.get(name, name)} | {rank} | {x['sm_mean']:.1f} % ({x['sm_min']:.0f} %)"
                f" | {x['memory_mean']:.1f} % | {x['cpu_cores']:.2f} cores"
                + (
                    f" | {ph['stalled_polls']} of {ph['polls']} |"
                    if name != "hang"
                    else f" | flagged {r.get('flagged_after_seconds', float('nan')):.1f} s in |"
                )
            )
    flagged = r.get("flagged_after_seconds")
    crossed = _load("gpu-stall-crossed-h200")
    crossed_text = ""
    if crossed is not None:
        c = crossed["results"]
        hang = c["phases"].get("hang", {}).get("ranks", {})
        healthy = sum(ph["polls"] for name, ph in c["phases"].items() if name != "hang")
        stalled = sum(ph["stalled_polls"] for name, ph in c["phases"].items() if name != "hang")
        crossed_text = (
            f"\nThe crossed run ({_provenance(crossed)}): each rank enters an all_reduce of another"
            " process group, so both kernels spin and both GPUs stay busy ("
            + ", ".join(f"rank {k} {x['sm_mean']:.0f} % SM" for k, x in hang.items())
            + ", as the two processes time-share one GPU): activity cannot tell this from work. The flight"
            " recorder, asked through the job's FIFO every 5 s while every GPU was busy, can: no collective"
            f" completed between two dumps, and both ranks were flagged `collective` {c.get('flagged_after_seconds', float('nan')):.1f} s"
            f" after the hang began; over the 60 s of training, with the same probes running, {stalled} of"
            f" {healthy} polls were stalled.\n"
        )
    return (
        f"`benchmarks/gpu_stall.py` ({_provenance(doc)}): two NCCL ranks on one GPU (each its own"
        f" `NCCL_HOSTID`, so NCCL carries their traffic over sockets), the daemon at `--stall-after"
        f" {r['settings']['stall_after']:.0f} --interval {r['settings']['interval']}`:\n\n"
        + "\n".join(rows)
        + "\n\n"
        + (
            f"The hang was flagged {flagged:.1f} s after it began (the threshold plus the 5 s window a rank"
            " is judged over): rank 0 `waiting`, its GPU busy while rank 1's ran nothing, rank 1 the"
            ' suspect; the snapshot asked both flight recorders through their FIFOs (rank 1 "never'
            " entered\" the collective) and took both stacks; the postmortem of rank 1's SIGKILL carries it."
            " The memory-busy column is why memory activity is not used to tell a spinning kernel from"
            " work: the small model's steps read 0 % too.\n"
            if flagged is not None
            else "The hang was not flagged.\n"
        )
        + crossed_text
    )


def gpu_stranded() -> str:
    doc = _load("gpu-stranded-h100")
    if doc is None:
        return _missing(
            "gpu-stranded-h100", "run `benchmarks/gpu_stranded.py` on a GPU machine, then `--results`"
        )
    r = doc["results"]
    rows = [
        "| scenario | survivor | NVML SM busy before the death, mean (min) | after it, mean (min) |"
        " memory busy after, max | stranded |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    says = {
        "killed": "rank 1 SIGKILLed, rank 0 in an all_reduce with it",
        "killed-other": "rank 1 SIGKILLed, rank 0 in an all_reduce with rank 2, which works on",
    }
    for mode, sc in r.items():
        for rank, x in sc["survivors"].items():
            b, a = x["before_death"], x["after_death"]
            told = (
                f"yes, {sc['death_to_stranded_s']:.1f} s after the death"
                if rank in sc["stranded_ranks"]
                else "no"
            )
            rows.append(
                f"| {says.get(mode, mode)} | {rank} | {b.get('sm_mean', 0):.0f} % ({b.get('sm_min', 0)} %)"
                f" | {a.get('sm_mean', 0):.0f} % ({a.get('sm_min', 0)} %) | {a.get('memory_max', 0)} % | {told} |"
            )
    return (
        f"`benchmarks/gpu_stranded.py` ({_provenance(doc)}): NCCL ranks on one GPU (each its own"
        " `NCCL_HOSTID`), each under its own torchrun agent so that no agent ends another's rank; 10 s"
        " of large matmuls, 10 s of a small MLP, then rank 1 SIGKILLs itself. No flight-recorder FIFO:"
        " the GPU's activity alone tells. NVML's per-process utilisation read beside the daemon every"
        " 0.5 s. Rank 0 of the first run kept its GPU spinning until NCCL's watchdog took the process"
        " down a minute later; in the second, rank 0 and rank 2 time-share the one GPU, so rank 0's"
        " kernel never holds it alone and is not told spinning (a rank owns its GPU in real jobs).\n\n"
        + "\n".join(rows)
        + "\n"
    )


def launchers() -> str:
    doc = _load("launchers")
    if doc is None:
        return _missing("launchers", "run `python benchmarks/launchers.py`")
    per = doc["results"]["launchers"]
    rows = [
        "| launcher | jobs | attach from the rank's start, median (max) | from its group join |"
        " death to postmortem, median (max) | verdicts | the other rank | death to stranded, median (max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in per.items():
        if "skipped" in r:
            rows.append(f"| {name} | skipped: {r['skipped']} | | | | | | |")
            continue
        s = r["summary"]
        strand = (
            f"{s['death_to_stranded_s_median']:.1f} s ({s['death_to_stranded_s_max']:.1f} s)"
            if "death_to_stranded_s_median" in s
            else "n/a (its launcher ends the others)"
        )
        after, worst = s.get("attach_after_join_s_median"), s.get("attach_after_join_s_max")
        if after is None:
            join = "n/a"
        elif after < 0:  # known by its environment before it joined
            join = "before it" + (f" (max {worst:.2f} s after)" if worst > 0 else "")
        else:
            join = f"{after:.2f} s ({worst:.2f} s)"
        rows.append(
            f"| {name} | {s['runs']} | {s['attach_s_median']:.2f} s ({s['attach_s_max']:.2f} s) | {join} |"
            f" {1000 * s['death_to_postmortem_s_median']:.0f} ms ({1000 * s['death_to_postmortem_s_max']:.0f} ms) |"
            f" {', '.join(s['killers'])}; victim right {s['victims_right']}/{s['runs']} |"
            f" {', '.join(s['survivor_fates'])} | {strand} |"
        )
    return (
        f"`benchmarks/launchers.py` ({_provenance(doc)}): real two-rank gloo jobs under each launcher,"
        " one real daemon each (sampling every 1 s); rank 1 SIGKILLed from outside. Attach: from the"
        " rank's process start to the first `/ranks` that lists it, and from its group join (the start of"
        " the first thread c10d started for it): a spawned rank is one once it joined its group, so its"
        " interpreter's start and imports are in its first figure; Lightning's rank 0 (the user's script)"
        " is known as one when it starts rank 1, after its imports. Slurm's jobs: half with"
        " `--kill-on-bad-exit=1`, half without, rank 0 left waiting for rank 1 in the store.\n\n"
        + "\n".join(rows)
        + "\n"
    )


RENDERERS: dict[str, Callable[[], str]] = {
    "overhead": overhead,
    "overhead_ab": overhead_ab,
    "deaths": deaths,
    "diagnose": diagnose,
    "pastes": pastes,
    "gpu": gpu,
    "steps": steps,
    "loaded": loaded,
    "foresight": foresight,
    "pss": pss_cost,
    "fuzz": fuzzing,
    "gpu_stall": gpu_stall,
    "story": story,
    "webauth": webauth,
    "launchers": launchers,
    "gpu_stranded": gpu_stranded,
}
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated: \2 -->)", re.S)


def pages() -> list[Path]:
    """The files that may hold generated blocks: README.md, then docs/*.md by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def render_all(texts: dict[Path, str]) -> dict[Path, str]:
    """Every file's text with its generated blocks rendered. Raises SystemExit naming each
    renderer whose block is in no file, or in more than one place."""
    places: dict[str, list[str]] = {name: [] for name in RENDERERS}
    out: dict[Path, str] = {}
    for path, text in texts.items():

        def one(m: re.Match[str], path: Path = path) -> str:
            name = m.group(2)
            if name not in RENDERERS:
                return m.group(0)
            places[name].append(_name(path))
            return m.group(1) + RENDERERS[name]() + m.group(4)

        out[path] = BLOCK.sub(one, text)
    missing = sorted(name for name, where in places.items() if not where)
    repeated = sorted(f"{name} ({', '.join(where)})" for name, where in places.items() if len(where) > 1)
    problems = []
    if missing:
        problems.append("no generated block in README.md or docs/*.md for: " + ", ".join(missing))
    if repeated:
        problems.append("a generated block appears more than once: " + "; ".join(repeated))
    if problems:
        raise SystemExit("\n".join(problems))
    return out


def main() -> int:
    texts = {path: path.read_text() for path in pages()}
    new = render_all(texts)
    changed = [path for path in texts if new[path] != texts[path]]
    if "--check" in sys.argv[1:]:
        for path in changed:
            name = _name(path)
            diff = difflib.unified_diff(
                texts[path].splitlines(), new[path].splitlines(), name, f"{name} (rendered)", lineterm=""
            )
            print("\n".join(diff))
        if changed:
            print(
                ", ".join(_name(p) for p in changed)
                + " differ from benchmarks/results/: run `python benchmarks/render.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    for path in changed:
        path.write_text(new[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
