"""Calibrated simulator against the live server, on the same workload.

The default system (``moeinfra serve up``: the tiny checkpoint with its DeepSeek-V3 tokenizer, one
prefill and one decode unit of two ranks, an on-disk KV cache) is calibrated with ``serve
calibrate``'s probe load; then a different workload — a Mooncake-style trace with Poisson arrivals
and a shared system-prompt block, never seen by the fit — is replayed live (``serve bench``) and
through the calibrated simulator (``serve simulate``'s model). The live replay runs ``--repeats``
times on the same server, each time with fresh prompt tokens (the machine is shared: one replay's
latencies move by ~20%); the table compares the median of the live figures with the prediction
and shows their range. Prints the calibration's fit and held-out errors and the live / predicted
table.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from moeinfra.server import bench as b
from moeinfra.server.calibrate import calibrate_live, compare, predict_replay
from moeinfra.server.process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    args = ["--block-size", "16", "--num-kv-blocks", "512", "--kv-cache-dir", str(folder / "kv"),
            "--prefill-units", "1", "--prefill-ranks", "2", "--decode-units", "1",
            "--decode-ranks", "2"]  # fmt: skip
    with ServerProcess(args) as server:
        calibration = calibrate_live(server.url)
        trace = b.synthetic_trace(folder / "trace.jsonl", opts.requests, opts.rate, seed=opts.seed)
        runs = []
        for repeat in range(opts.repeats):
            # the same trace with fresh prompt tokens: a repeat of the same prompts would find
            # them in the server's prefix caches, which the simulated trace does not have
            requests = b.trace_requests(trace, vocab=1000, block_tokens=64, seed=repeat)
            results, wall = asyncio.run(b.replay(server.url, requests))
            runs.append(b.summarize(results, wall))
    predicted = predict_replay(trace, calibration)
    rows = [compare(live, predicted) for live in runs]
    errors = calibration.errors()
    print(f"calibration factors: {calibration.factors}")
    jitter = calibration.prefill_step_jitter
    if jitter:
        print(
            "prefill step / like steps' median, min / 5 / 50 / 95th percentile / max: "
            + " / ".join(
                f"{np.interp(q, np.linspace(0, 1, len(jitter)), jitter):.2f}"
                for q in (0.0, 0.05, 0.5, 0.95, 1.0)
            )
        )
        steady = predict_replay(trace, replace(calibration, prefill_step_jitter=()))
        print(
            "without the spread: TTFT p50 / p95 "
            f"{steady['ttft_s']['p50'] * 1e3:.1f} / {steady['ttft_s']['p95'] * 1e3:.1f} ms"
        )
    for split in ("fit", "validation"):
        e = errors[split]
        print(
            f"{split}: {e['points']} points ({e['steps']} steps), median |error| "
            f"{e['median_abs']:.1%}, mean {e['mean_abs']:.1%}, worst {e['max_abs']:.1%}"
        )
    errors_live = sum(live["errors"] for live in runs)
    print(f"\n{opts.requests} requests at {opts.rate}/s, {opts.repeats} live replays, ", end="")
    print(f"{errors_live} errors\n")
    print("| figure | live (median) | live range | calibrated simulator | error |")
    print("|---|---:|---:|---:|---:|")
    for k, row in enumerate(rows[0]):
        scale = 1e3 if "(s)" in row["figure"] else 1.0
        label = row["figure"].replace("(s)", "(ms)")
        values = sorted(r[k]["live"] * scale for r in rows)
        median = float(np.median(values))
        predicted_value = row["predicted"] * scale
        print(
            f"| {label} | {median:.1f} | {values[0]:.1f}-{values[-1]:.1f} | "
            f"{predicted_value:.1f} | {predicted_value / median - 1:+.0%} |"
        )


if __name__ == "__main__":
    main()
