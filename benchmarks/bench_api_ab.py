"""What a change to the server costs a served burst: this tree against an earlier commit, A/B.

Run: ``.venv/bin/python -m benchmarks.bench_api_ab --base COMMIT [--reps 5]`` (not CI; about a
minute per repetition on 2 cores). The earlier commit is checked out as a git worktree under
``build/`` and served with its own sources first on ``PYTHONPATH`` (the same virtual environment).
Each repetition serves the served section's workload of ``bench_vs_vllm`` — 32 requests of 128
random prompt tokens and 64 output tokens (EOS ignored) sent at once, fresh prompts each repetition
— to a fresh server of each tree in turn (the order alternates), one colocated rank, on the
``small`` checkpoint of ``bench_vs_vllm`` (DeepSeek-V3's tokenizer), with moeinfra's streaming
client (``moeinfra.server.bench``): ``--bursts`` bursts per server, the first left out (it builds
oneDNN kernels for new shapes and varies most), the others' median kept; the first ``--warmup``
repetitions are left out too (a tree's first server builds its C++ kernels). It prints output
tokens/s, TTFT p50 and TPOT p50 per tree (medians, ranges) and the per-repetition ratios
this / base.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from benchmarks.bench_vs_vllm import SMALL

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
READY = re.compile(r"ready at (http://[^/\s]+)/v1")


def _serve(tree: Path, model: Path, dtype: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    cmd = [sys.executable, "-m", "moeinfra.cli", "serve", "up", "--model", str(model),
           "--port", "0", "--dtype", dtype, "--prefill-units", "0", "--decode-units", "0",
           "--colocated-units", "1", "--colocated-ranks", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=tree)
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            match = READY.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300) or not found:
        proc.kill()
        raise RuntimeError(f"the server of {tree} did not start")
    return proc, found[0]


def _burst(url: str, seed: int) -> dict:
    from moeinfra.server.bench import BenchRequest, replay, summarize

    rng = np.random.default_rng(seed)
    requests = [BenchRequest(0.0, rng.integers(1000, 100_000, 128).tolist(), 64) for _ in range(32)]
    results, wall = asyncio.run(replay(url, requests))
    summary = summarize(results, wall)
    assert summary["errors"] == 0, summary["error_examples"]
    return {
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "ttft_p50_ms": 1000 * summary["ttft_s"]["p50"],
        "tpot_p50_ms": 1000 * summary["tpot_s"]["p50"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bursts", type=int, default=3, help="per server; the first is left out")
    parser.add_argument("--warmup", type=int, default=1, help="repetitions left out at the start")
    args = parser.parse_args()
    from moeinfra.engine.tiny import init_tiny

    model = BUILD / "ab-small"
    if not (model / "config.json").exists():
        init_tiny(model, config=SMALL, overwrite=True)
    base = BUILD / f"ab-{args.base[:12]}"
    if not base.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
    trees = {"this": ROOT, "base": base}
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    for rep in range(args.reps):
        order = list(trees) if rep % 2 == 0 else list(trees)[::-1]
        for name in order:
            proc, url = _serve(trees[name], model, args.dtype)
            try:
                # a server's first burst builds oneDNN kernels for new shapes: it is left out
                bursts = [_burst(url, seed=1000 * rep + b) for b in range(args.bursts)][1:]
                rows[name].append({k: statistics.median(b[k] for b in bursts) for k in bursts[0]})
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
            print(f"rep {rep} {name}: {rows[name][-1]}", flush=True)
    rows = {name: kept[args.warmup :] for name, kept in rows.items()}
    for key in ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms"):
        cells = []
        for name in trees:
            values = [r[key] for r in rows[name]]
            cells.append(
                f"{name} {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
            )
        ratios = [a[key] / b[key] for a, b in zip(rows["this"], rows["base"], strict=True)]
        print(f"{key}: {'; '.join(cells)}; this/base {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
