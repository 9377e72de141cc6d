"""``moeinfra serve plan`` on DeepSeek's day against DeepSeek's own units, and its cost in time.

Each run is a fresh process of the console command (``--json`` to a pipe): the first ``--hours``
of DeepSeek's generated day, TTFT p95 <= 2 s, TPOT p95 <= 50 ms, H800, one simulated request per
100 real, every default shape (disaggregated and aggregated) — first principles, the
``deepseek-h800`` calibration, that calibration with MTP at 0.85 acceptance, and ``rtp-llm-h800``.
Prints a Markdown table: the chosen prefill and decode units, the best aggregated fleet, shapes
simulated and pruned, wall time and peak resident memory.

Run: ``.venv/bin/python -m benchmarks.bench_planner [--hours 4] [--variant NAME ...]`` (8 to 35
minutes per row at 4 hours on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "first principles": ["--calibration", "none"],
    "deepseek-h800": ["--calibration", "deepseek-h800"],
    "deepseek-h800, MTP 0.85": ["--calibration", "deepseek-h800", "--mtp-acceptance", "0.85"],
    "rtp-llm-h800": ["--calibration", "rtp-llm-h800"],
}


def run_once(args: list[str]) -> tuple[float, int, dict]:
    """Wall seconds, peak resident bytes and the JSON plan of one ``serve plan`` process."""
    cmd = [sys.executable, "-m", "moeinfra.cli", "serve", "plan", "--json", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024, json.loads(out)


def units(option: dict | None) -> str:
    if option is None:
        return "none meets the SLOs"
    mtp = f", MTP {option['mtp_acceptance']:g}" if option["mtp_acceptance"] else ""
    return (
        f"{option['units']} x {option['nodes']} nodes (R{option['redundant_experts']}, "
        f"{option['micro_batches']} mb{mtp})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=4.0)
    parser.add_argument(
        "--variant", action="append", choices=list(VARIANTS), help="rows to run (default: all)"
    )
    args = parser.parse_args(argv)
    print(
        "| model | prefill | decode | fleet (nodes) | best aggregated (nodes) | shapes simulated / "
        "pruned / unfit | wall (s) | peak RSS (MB) |"
    )
    print("|---|---|---|---:|---:|---|---:|---:|")
    for name in args.variant or VARIANTS:
        extra = VARIANTS[name]
        wall, rss, plan = run_once(["--hours", f"{args.hours:g}", "--scale", "100", *extra])
        searched = sum(o["searched"] for o in plan["options"])
        colocated = plan["colocated"]
        print(
            f"| {name} | {units(plan['prefill'])} | {units(plan['decode'])} | {plan['nodes']} | "
            f"{'-' if colocated is None else colocated['total_nodes']} | "
            f"{searched} / {len(plan['options']) - searched} / {len(plan['unfit'])} | "
            f"{wall:.0f} | {rss / 1e6:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
