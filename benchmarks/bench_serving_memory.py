"""Peak memory per sampled request and wall time of ``moeinfra serve simulate`` on DeepSeek's day.

Each run is a fresh process of the console command (``--json`` to a pipe); its peak resident set
comes from ``os.wait4`` (the child's own ``ru_maxrss``). Bytes per sampled request = (peak of the
run - peak of a 36-second run of the same command, which holds the interpreter, numpy, numba and
the model but almost no requests) / sampled requests. Target (#13): <= 64 bytes, so that a 1:1
replay of the day (155M requests) fits a 24 GB machine.

Run: ``.venv/bin/python -m benchmarks.bench_serving_memory [--scales 100 10] [--reps 1]``.
Prints a Markdown table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_once(args: list[str]) -> tuple[float, int, dict]:
    """Wall seconds, peak resident bytes and the JSON output of one ``serve simulate`` process."""
    cmd = [sys.executable, "-m", "moeinfra.cli", "serve", "simulate", "--json", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (ru_maxrss in KiB)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024, json.loads(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[100.0, 10.0])
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args(argv)
    _, base, _ = run_once(["--hours", "0.01"])
    print(f"baseline (--hours 0.01): peak {base / 2**20:,.0f} MiB\n")
    print("| --scale | sampled requests | wall s | peak MiB | bytes per sampled request |")
    print("|---:|---:|---:|---:|---:|")
    for scale in args.scales:
        runs = [run_once(["--scale", f"{scale:g}"]) for _ in range(max(args.reps, 1))]
        wall = statistics.median(r[0] for r in runs)
        peak = statistics.median(r[1] for r in runs)
        sampled = runs[0][2]["requests"]["sampled"]
        print(
            f"| {scale:g} | {sampled:,} | {wall:.1f} | {peak / 2**20:,.0f} | "
            f"{(peak - base) / sampled:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
