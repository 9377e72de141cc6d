"""Live server on the tiny checkpoint: prefill/decode disaggregation against colocated units on the
same cores and the same bursty workload (TTFT and TPOT side by side).

Both systems run two engine ranks (one process each, one rank per unit): disaggregated = 1 prefill
unit + 1 decode unit; colocated = 2 colocated units. The workload is synthetic (prompts of 200-600
tokens, 32-64 output tokens) arriving in bursts: a Poisson process whose rate alternates between
a high and a low phase. Prints a Markdown table of one run of each.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np

from moeinfra.engine.tiny import init_tiny
from moeinfra.server import bench as b
from moeinfra.server.process import ServerProcess

ENGINE = ["--block-size", "16", "--num-kv-blocks", "1024", "--max-num-batched-tokens", "512"]


def bursty(num_requests: int, seed: int) -> list[b.BenchRequest]:
    requests = b.synthetic_requests(
        num_requests, vocab=1000, input_tokens=(200, 600), output_tokens=(32, 64), seed=seed
    )
    rng = np.random.default_rng(seed)
    t = 0.0
    for i, r in enumerate(requests):
        rate = 12.0 if (i // 8) % 2 == 0 else 1.5  # bursts of 8 fast arrivals, then 8 slow
        t += rng.exponential(1 / rate)
        r.arrival_s = t
    return requests


def run(args: list[str], requests, model) -> dict:
    with ServerProcess(["--model", str(model), *ENGINE, *args]) as server:
        asyncio.run(b.replay(server.url, requests[:2]))  # warm-up (not measured)
        results, wall = asyncio.run(b.replay(server.url, requests))
    return b.summarize(results, wall)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="bpe")
    opts = parser.parse_args()
    folder = tempfile.TemporaryDirectory()
    model = init_tiny(Path(folder.name) / "tiny", tokenizer=opts.tokenizer)
    requests = bursty(opts.requests, opts.seed)
    systems = {
        "disaggregated (1 prefill + 1 decode unit)": [
            "--prefill-ranks", "1", "--decode-ranks", "1",
        ],
        "colocated (2 units)": [
            "--prefill-units", "0", "--decode-units", "0",
            "--colocated-units", "2", "--colocated-ranks", "1",
        ],
    }  # fmt: skip
    print("| system | TTFT p50 (ms) | TTFT p95 (ms) | TPOT p50 (ms) | TPOT p95 (ms) | "
          "output tok/s | errors |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, args in systems.items():
        s = run(args, requests, model)
        print(
            f"| {name} | {s['ttft_s']['p50'] * 1e3:.0f} | {s['ttft_s']['p95'] * 1e3:.0f} | "
            f"{s['tpot_s']['p50'] * 1e3:.1f} | {s['tpot_s']['p95'] * 1e3:.1f} | "
            f"{s['throughput']['output_tokens_per_s']:.0f} | {s['errors']} |",
            flush=True,
        )
    folder.cleanup()


if __name__ == "__main__":
    main()
