"""``make mutate``: mutation testing of each package's core modules with mutmut.

For each package a working copy of ``src/``, ``tests/`` and ``examples/`` is made under
``build/mutate/<package>/`` with a ``[tool.mutmut]`` section naming the package's core modules and
the tests chosen for them (no CLI tests: a test that runs ``moeinfra`` in a subprocess imports the
unmutated code and can kill nothing). mutmut then runs each mutant against the tests that cover
the mutated function.

By default 1 in 5 mutants is run (``--sample``), chosen by mutant number so the same ones are run
each time, and every one of them is checked again on each run (mutmut re-runs mutants named on its
command line). With ``--sample 1`` mutmut resumes: a killed mutant keeps its verdict until its
function changes, and surviving and untested ones are checked again (the tests may have changed).
Afterwards the summary (per module: mutants, killed, timeout, survived, no tests, equivalent,
other) replaces the table between the ``mutate-summary`` markers in ``docs/testing.md`` (after a
run of every package), and each surviving mutant not listed in ``tools/equivalent_mutants.toml`` is
written with its diff to ``build/mutate/survivors.txt``.

Run: ``make mutate`` or ``.venv/bin/python tools/mutate.py [--packages eplb,trace] [--sample 1]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutate"
EQUIVALENT = ROOT / "tools" / "equivalent_mutants.toml"
SUMMARY_DOC = ROOT / "docs" / "testing.md"
KERNEL_DECORATOR = re.compile(r"^@kernel\([^)]*\)\s*$")
NO_MUTATE_LINES = r"^\s*raise \w+\("
BEGIN, END = "<!-- mutate-summary:start -->", "<!-- mutate-summary:end -->"


@dataclass(frozen=True)
class Target:
    """One package: the modules mutated and the test files run against them."""

    modules: tuple[str, ...]
    tests: tuple[str, ...]
    #: tests that run some code in spawned processes, by name prefix under the package (a module
    #: with its dot, or a function): mutmut maps a function only to the tests that call it in their
    #: own process, so these are added to every function the prefix names
    spawned: tuple[tuple[str, tuple[str, ...]], ...] = ()


TARGETS = {
    "eplb": Target(
        ("policy", "local_search", "packing", "deepseek", "migration", "dispatch"),
        (
            "test_building_blocks",
            "test_deepseek",
            "test_estimator_dispatch",
            "test_fuzz",
            "test_metrics",
            "test_migration",
            "test_policy",
            "test_shift_replicas",
            "test_weak_spots",
        ),
    ),
    "trace": Target(
        ("overlap", "attribution", "intervals"),
        (
            "test_trace_intervals",
            "test_trace_metrics",
            "test_trace_deepseek",
            "test_trace_hta",
            "test_trace_weak_spots",
            "test_trace_steps_idle_launches",
        ),
    ),
    "pipeline": Target(
        ("generators", "simulate"),
        ("test_schedules", "test_simulate", "test_weak_spots"),
    ),
    "moe": Target(
        ("gate", "expert_parallel", "runtime"),
        ("test_model", "test_schedules", "test_weak_spots", "test_comm", "test_distributed"),
        # two ranks run every check (migration, hot-expert spread, splits) in ~5 s; the load's
        # all-reduce on a process group of part of the world needs four
        spawned=(
            ("expert_parallel.", ("tests/moe/test_distributed.py::test_all_checks[2]",)),
            ("runtime.", ("tests/moe/test_distributed.py::test_all_checks[2]",)),
            (
                "expert_parallel.xǁExpertParallelMoEǁtake_load",
                ("tests/moe/test_distributed.py::test_all_checks[4]",),
            ),
        ),
    ),
    "serving": Target(
        (
            "perfmodel/step",
            "perfmodel/roofline",
            "perfmodel/all_to_all",
            "perfmodel/indexer",
            "perfmodel/memory",
            "perfmodel/deepseek_v3",
            "perfmodel/deepseek_v32",
            "perfmodel/deepseek_v4",
            "deepep",
            "kernels",
            "simulate",
            "schedule",
            "cost",
        ),
        (
            "test_model",
            "test_deepep",
            "test_kernels",
            "test_against_aiconfigurator",
            "test_simulate",
            "test_weak_spots",
            "test_balancers",
            "test_workload",
            "test_reproduction",
            "test_uncertainty",
            "test_memory_fit",
            "test_frontier",
        ),
    ),
}


def _mutmut_section(package: str, target: Target) -> str:
    modules = [f"src/moeinfra/{package}/{m}.py" for m in target.modules]
    tests = [f"tests/{package}/{t}.py" for t in target.tests]
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["src/"]\n'
        f"only_mutate = {json.dumps(modules)}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps([*tests, '-m', 'not slow'])}\n"
        # an error's message is checked by the tests of bad input, not by mutants of its text
        f"do_not_mutate_patterns = {json.dumps([NO_MUTATE_LINES])}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "--timeout=600"]\n'
        'also_copy = ["examples/"]\n'
        # torch is not fork-safe once used: fork each mutant's run from a clean server process
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
        # a mutant that makes the simulator loop far longer counts as detected after 4x its tests'
        # time (mutmut's default, 30x, lets a few such mutants take most of a run)
        "timeout_multiplier = 2.0\n"
    )


def _prepare(package: str, target: Target) -> Path:
    work = WORK / package
    work.mkdir(parents=True, exist_ok=True)
    for folder in ("src", "tests", "examples"):
        shutil.copytree(
            ROOT / folder,
            work / folder,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc", "*.ok"),
        )
    for module in target.modules:
        _undecorate_kernels(work / "src" / "moeinfra" / package / f"{module}.py")
    text = (ROOT / "pyproject.toml").read_text() + _mutmut_section(package, target)
    config = work / "pyproject.toml"
    if config.exists() and config.read_text() != text:
        # mutmut regenerates only files whose source changed: start afresh on a new selection
        shutil.rmtree(work / "mutants", ignore_errors=True)
    config.write_text(text)
    return work


def _undecorate_kernels(path: Path) -> None:
    """Drop the EPLB kernels' ``@kernel(...)`` lines in the working copy: mutmut does not mutate
    decorated functions, and with ``MOEINFRA_EPLB_JIT=interpreted`` the decorator returns the
    function unchanged, so the copy runs the same code."""
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not KERNEL_DECORATOR.match(line)]
    if len(kept) != len(lines):
        path.write_text("".join(kept))


#: ``--sample N``: the mutants whose number ends in one of these digits (mutmut numbers each
#: function's mutants 1, 2, 3, ...), so every function with enough mutants is sampled.
SAMPLE_DIGITS = {1: "0123456789", 2: "02468", 5: "05", 10: "0"}


def _in_sample(name: str, sample: int) -> bool:
    return name[-1] in SAMPLE_DIGITS[sample]


def _recheck_survivors(work: Path) -> None:
    """Forget the results of surviving and untested mutants so this run checks them again with
    the current tests (mutmut keeps a result until the mutated function changes)."""
    for meta in (work / "mutants").rglob("*.py.meta"):
        data = json.loads(meta.read_text())
        codes = data["exit_code_by_key"]
        stale = [
            k for k, v in codes.items() if v is not None and STATUS[v] in ("survived", "no tests")
        ]
        if stale:
            codes.update(dict.fromkeys(stale))
            _write_atomic(meta, json.dumps(data))


def _map_spawned_tests(package: str, target: Target, work: Path, cmd: list[str], env: dict) -> None:
    """Collect mutmut's stats, then add ``target.spawned``'s tests to every function their prefixes
    name."""
    stats = work / "mutants" / "mutmut-stats.json"
    # mutmut has no stats-only command: a filter that matches no mutant (every name ends in a digit)
    # collects and saves the stats, then stops
    subprocess.run([*cmd, "*[!0-9]"], cwd=work, env=env, capture_output=True, check=False)
    if not stats.exists():
        raise SystemExit(f"{package}: mutmut did not collect its stats in {work}/mutants")
    data = json.loads(stats.read_text())
    tests = data["tests_by_mangled_function_name"]
    for prefix, spawned in target.spawned:
        for name in data["function_hashes"]:
            if name.startswith(f"moeinfra.{package}.{prefix}"):
                tests[name] = sorted(set(tests.get(name, [])) | set(spawned))
    _write_atomic(stats, json.dumps(data))


def _run(package: str, work: Path, max_children: int, sample: int) -> float:
    env = {
        **os.environ,
        # the EPLB kernels as Python, so mutants reach them (numba would compile each mutant)
        "MOEINFRA_EPLB_JIT": "interpreted",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    start = time.monotonic()
    mutmut = Path(sys.executable).parent / "mutmut"
    cmd = [str(mutmut), "run", "--max-children", str(max_children)]
    # mutmut maps only new test names to the functions they run: a test changed since the last
    # run would keep its old map, so every run collects the map afresh
    (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    target = TARGETS[package]
    if target.spawned:
        _map_spawned_tests(package, target, work, cmd, env)
    if sample > 1:
        cmd.append(f"*[{SAMPLE_DIGITS[sample]}]")
    print(f"== {package}: {' '.join(cmd)} in {work.relative_to(ROOT)}", flush=True)
    subprocess.run(cmd, cwd=work, env=env, check=True)
    return time.monotonic() - start


#: mutmut's statuses, as counted here: a mutant whose tests hang until mutmut's timeout is
#: detected (as in PIT and Stryker); "no tests" is a mutant no chosen test runs.
STATUS = status_by_exit_code
COLUMNS = ("killed", "timeout", "survived", "no tests", "equivalent", "other")


def _counts(
    package: str, target: Target, work: Path, equivalent: dict[str, str], sample: int
) -> list[dict]:
    rows = []
    for module in target.modules:
        meta = work / "mutants" / "src" / "moeinfra" / package / f"{module}.py.meta"
        exit_codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        exit_codes = {k: v for k, v in exit_codes.items() if _in_sample(k, sample)}
        row = {"module": f"{package}/{module}.py", "mutants": len(exit_codes), "survivors": []}
        row |= dict.fromkeys(COLUMNS, 0)
        for name, code in exit_codes.items():
            status = STATUS[code]
            if status == "survived" and name in equivalent:
                status = "equivalent"
            row[status if status in COLUMNS else "other"] += 1
            if status in ("survived", "no tests"):
                row["survivors"].append(name)
        rows.append(row)
    return rows


def _score(row: dict) -> str:
    real = row["mutants"] - row["equivalent"]
    return f"{100 * (row['killed'] + row['timeout']) / real:.1f}%" if real else "-"


def _table(results: dict[str, dict]) -> str:
    lines = [
        "| package | module | mutants | " + " | ".join(COLUMNS) + " | detected |",
        "|---|---|" + "---:|" * (len(COLUMNS) + 2),
    ]
    for package, result in results.items():
        rows = result["rows"]
        total = {k: sum(r[k] for r in rows) for k in ("mutants", *COLUMNS)}
        for row in rows:
            cells = " | ".join(str(row[c]) for c in COLUMNS)
            lines.append(
                f"| {package} | `{row['module']}` | {row['mutants']} | {cells} | {_score(row)} |"
            )
        cells = " | ".join(f"**{total[c]}**" for c in COLUMNS)
        lines.append(
            f"| **{package}** | all ({result['minutes']:.1f} min) | **{total['mutants']}** | {cells} "
            f"| **{_score(total)}** |"
        )
    return "\n".join(lines)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _sample_text(sample: int) -> str:
    return "every mutant" if sample == 1 else f"1 in {sample}"


def _today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _update_doc(results: dict[str, dict]) -> None:
    from importlib.metadata import version

    doc = SUMMARY_DOC.read_text()
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    body = (
        f"{BEGIN}\nmutmut {version('mutmut')}; each package's latest run (mutants run): "
        + "; ".join(f"{p} {r['date']}, {_sample_text(r['sample'])}" for p, r in results.items())
        + f"; {sum(r['minutes'] for r in results.values()):.0f} min for all five.\n\n"
        f"{_table(results)}\n{END}"
    )
    _write_atomic(SUMMARY_DOC, head + body + tail)


def _survivors(results: dict[str, dict]) -> str:
    out = []
    mutmut = Path(sys.executable).parent / "mutmut"
    for result in results.values():
        for row in result["rows"]:
            for name in row["survivors"]:
                shown = subprocess.run(
                    [str(mutmut), "show", name],
                    cwd=result["work"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                out.append(shown.stdout.strip() or name)
    return "\n\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packages", default=",".join(TARGETS), help="comma-separated")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--sample",
        type=int,
        default=5,
        choices=sorted(SAMPLE_DIGITS),
        help="run 1 in N mutants (1: all)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="count the verdicts of the last run in build/mutate without running mutants",
    )
    parser.add_argument(
        "--no-doc", action="store_true", help="do not rewrite docs/testing.md's summary"
    )
    args = parser.parse_args(argv)
    packages = [p for p in args.packages.split(",") if p]
    unknown = sorted(set(packages) - set(TARGETS))
    if unknown:
        parser.error(f"--packages={args.packages}: unknown {unknown}; allowed {sorted(TARGETS)}")
    equivalent = tomllib.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}
    if not args.report_only:
        for package in packages:
            work = _prepare(package, TARGETS[package])
            if args.sample == 1:
                _recheck_survivors(work)
            seconds = _run(package, work, args.max_children, args.sample)
            run = {"minutes": seconds / 60, "sample": args.sample, "date": _today()}
            _write_atomic(work / "run.json", json.dumps(run))
    # every package's latest run, so one package's re-run updates its rows of the summary
    results = {}
    for package, target in TARGETS.items():
        work = WORK / package
        if not (work / "run.json").exists():
            continue
        run = json.loads((work / "run.json").read_text())
        rows = _counts(package, target, work, equivalent.get(package, {}), run["sample"])
        results[package] = {"rows": rows, **run, "work": work}
    print(_table(results))
    if results:
        ran = {p: results[p] for p in packages if p in results}
        _write_atomic(WORK / "survivors.txt", _survivors(ran))
    if not args.no_doc and set(results) == set(TARGETS):
        _update_doc(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
