"""Calibrated simulator against the live server, on the same workload.

The default system (``moeinfra serve up``: the tiny checkpoint with its DeepSeek-V3 tokenizer, one
prefill and one decode unit of two ranks, an on-disk KV cache) is calibrated with ``serve
calibrate``'s probe load; then a different workload — a Mooncake-style trace with Poisson arrivals
and a shared system-prompt block, never seen by the fit — is replayed live (``serve bench``) and
through the calibrated simulator (``serve simulate``'s model). Prints the calibration's fit and
held-out errors and the live / predicted table, one run each.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from moeinfra.server import bench as b
from moeinfra.server.calibrate import calibrate_live, compare, predict_replay
from moeinfra.server.process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    args = ["--block-size", "16", "--num-kv-blocks", "512", "--kv-cache-dir", str(folder / "kv")]
    with ServerProcess(args) as server:
        calibration = calibrate_live(server.url)
        trace = b.synthetic_trace(folder / "trace.jsonl", opts.requests, opts.rate, seed=opts.seed)
        requests = b.trace_requests(trace, vocab=1000, block_tokens=64)
        results, wall = asyncio.run(b.replay(server.url, requests))
        live = b.summarize(results, wall)
    predicted = predict_replay(trace, calibration)
    errors = calibration.errors()
    print(f"calibration factors: {calibration.factors}")
    for split in ("fit", "validation"):
        e = errors[split]
        print(
            f"{split}: {e['points']} points ({e['steps']} steps), median |error| "
            f"{e['median_abs']:.1%}, mean {e['mean_abs']:.1%}, worst {e['max_abs']:.1%}"
        )
    print(f"\n{opts.requests} requests at {opts.rate}/s, {live['errors']} errors live\n")
    print("| figure | live | calibrated simulator | error |")
    print("|---|---:|---:|---:|")
    for row in compare(live, predicted):
        scale = 1e3 if "(s)" in row["figure"] else 1.0
        label = row["figure"].replace("(s)", "(ms)")
        print(
            f"| {label} | {row['live'] * scale:.1f} | {row['predicted'] * scale:.1f} | "
            f"{row['error']:+.0%} |"
        )


if __name__ == "__main__":
    main()
