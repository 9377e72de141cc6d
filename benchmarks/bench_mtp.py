"""MTP speculative decoding on a trained tiny DeepSeek-V3: training time and loss, draft acceptance
for 1-3 drafts per step, decode tokens/s with and without drafts at 1, 8 and 32 requests.

Run: ``.venv/bin/python -m benchmarks.bench_mtp [--steps 300] [--reps 3]``

1. ``moeinfra.train.train`` with its defaults (DualPipeV over 2 gloo ranks, 300 steps of 16
   sequences of 64 tokens of the shipped corpus): wall time, first and last loss.
2. Acceptance (greedy): prompts are the first 40 characters of 32 corpus lines (text the model was
   trained on) and 8 sentences it was not; 64 output tokens each; the engine's acceptance per draft
   position and mean acceptance length (1 + accepted drafts per verification).
3. Throughput: ``c`` requests of corpus prompts, 64 greedy output tokens each (EOS ignored), all
   submitted at once; output tokens / wall time of ``generate``, medians of ``--reps`` runs after a
   warm-up, without drafts and with 1, 2, 3; one thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from moeinfra.engine import LLM, SamplingParams
from moeinfra.train import TrainConfig, train

NEW = [
    "The weather in the mountains",
    "A recipe for bread needs",
    "Trains leave the station at",
    "My favourite book is",
    "Music fills the hall when",
    "The river flows past",
    "Children play in the park",
    "Coffee is best served",
]
OUTPUT_TOKENS = 64


def corpus_prompts(count: int) -> list[str]:
    text = resources.files("moeinfra.engine").joinpath("data/tiny_corpus.txt").read_text()
    lines = [line for line in text.splitlines() if len(line) > 60]
    step = max(1, len(lines) // count)
    return [line[:40] for line in lines[::step]][:count]


def acceptance(path: Path, prompts: list[str], k: int) -> dict:
    llm = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm._core.spec_stats
    per_position = (stats.per_position / max(stats.num_drafts, 1)).tolist()
    return {"per_position": per_position, "length": stats.mean_acceptance_length}


def throughput(path: Path, prompts: list[str], k: int, reps: int) -> float:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(path, speculative_config=spec, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(len(prompts) * OUTPUT_TOKENS / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path, losses = train(Path(tmp) / "trained", TrainConfig(steps=args.steps))
        took = time.perf_counter() - start
        print(
            f"training: {args.steps} steps, DualPipeV on 2 gloo ranks, {took:,.1f} s; loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f}\n"
        )
        torch.set_num_threads(1)
        print("| prompts | drafts | accepted at 1 | at 2 | at 3 | mean acceptance length |")
        print("|---|---|---|---|---|---|")
        for name, prompts in (("corpus", corpus_prompts(32)), ("new", NEW)):
            for k in (1, 2, 3):
                a = acceptance(path, prompts, k)
                cells = [f"{100 * p:.0f}%" for p in a["per_position"]] + ["—"] * (3 - k)
                print(f"| {name} | {k} | {' | '.join(cells)} | {a['length']:.2f} |", flush=True)
        print("\n| requests | no drafts | 1 draft | 2 drafts | 3 drafts |  (output tokens/s)")
        print("|---|---|---|---|---|")
        for concurrency in (1, 8, 32):
            prompts = corpus_prompts(concurrency)
            rates = [throughput(path, prompts, k, args.reps) for k in (0, 1, 2, 3)]
            base = rates[0]
            cells = [f"{base:,.0f}"] + [f"{r:,.0f} ({r / base:.2f}x)" for r in rates[1:]]
            print(f"| {concurrency} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
