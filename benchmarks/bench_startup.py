"""Whole-process start-up of the CLI: ``moeinfra --help`` and a trace report of DeepSeek's training
trace (#14 item 9: both <= 0.3 s).

Run: ``.venv/bin/python -m benchmarks.bench_startup [--reps 21]``

Each measurement is a new process of the installed ``moeinfra`` script, timed from spawn to exit.
Python writes and reads its bytecode cache as an installed package does (``PYTHONDONTWRITEBYTECODE``
is removed from the children's environment, and one untimed run per command writes the cache).
The commands are interleaved so each sees the same machine load. Prints medians and quartiles, and
the versions of typer and numpy, the two libraries start-up depends on most.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

_TRACE = Path(__file__).resolve().parent.parent / "examples" / "data" / "deepseek_train_trace.json"
_COMMANDS = {
    "moeinfra --help": ["--help"],
    "moeinfra trace report train.json": ["trace", "report", str(_TRACE)],
    "moeinfra trace report train.json --json": ["trace", "report", str(_TRACE), "--json"],
}


def _run(script: Path, args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([str(script), *args], env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args(argv)
    script = Path(sys.executable).parent / "moeinfra"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for command in _COMMANDS.values():
        _run(script, command, env)
    times: dict[str, list[float]] = {name: [] for name in _COMMANDS}
    for _ in range(args.reps):
        for name, command in _COMMANDS.items():
            times[name].append(_run(script, command, env))
    print(f"typer {version('typer')}, numpy {version('numpy')}, {args.reps} runs each\n")
    print("| command | median (s) | quartiles (s) |\n|---|---|---|")
    for name, runs in times.items():
        q1, _, q3 = statistics.quantiles(runs, n=4)
        print(f"| `{name}` | {statistics.median(runs):.2f} | {q1:.2f}–{q3:.2f} |")


if __name__ == "__main__":
    main()
