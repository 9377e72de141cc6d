"""One system's offline runs for ``bench_vs_vllm`` in a process of its own: moeinfra's ``LLM``,
``transformers``' ``generate`` or vLLM's ``LLM`` (the last run by the vLLM venv's Python, so this
file imports nothing of moeinfra at module level).

``python benchmarks/offline_worker.py SYSTEM CHECKPOINT DTYPE OUT.json C [C ...]``: for each
concurrency ``C``, ``C`` requests of 64-256 random prompt tokens (seeded: every system gets the
same ids) and 64 greedy output tokens with EOS ignored, submitted at once; one warm-up run, then
one timed run, or the median of :data:`SHORT_RUNS` where ``C`` is at most :data:`FEW_REQUESTS`
(such a run lasts ~0.3-0.6 s on 2 cores, the size of this machine's hiccups). Writes
``{C: {"tokens_per_s", "tokens"}}``.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

OUTPUT_TOKENS = 64
THREADS = 2
FEW_REQUESTS, SHORT_RUNS = 8, 3


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 120_000) for _ in range(rng.randint(64, 256))] for _ in range(n)]


def moeinfra_runner(path: str, dtype: str, concurrency: list[int]):
    from moeinfra.engine import LLM, SamplingParams

    llm = LLM(
        path, dtype=dtype, device="cpu", enable_prefix_caching=False, max_num_seqs=max(concurrency)
    )
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)

    def run(prompts):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return run


def transformers_runner(path: str, dtype: str, concurrency: list[int], device: str = "cpu"):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.to(device).eval()

    def run(prompts):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=OUTPUT_TOKENS,
                min_new_tokens=OUTPUT_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, width:].tolist()

    return run


def vllm_runner(path: str, dtype: str, concurrency: list[int]):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        path,
        dtype=dtype,
        max_num_seqs=max(concurrency),
        max_model_len=4096,
        enable_prefix_caching=False,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)

    def run(prompts):
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


RUNNERS = {"moeinfra": moeinfra_runner, "transformers": transformers_runner, "vllm": vllm_runner}


def main(argv: list[str]) -> None:
    system, path, dtype, out = argv[:4]
    concurrency = [int(c) for c in argv[4:]]
    import torch

    torch.set_num_threads(THREADS)
    began = time.perf_counter()
    run = RUNNERS[system](path, dtype, concurrency)
    results = {"startup_s": time.perf_counter() - began, "by_concurrency": {}}
    for c in concurrency:
        prompts = workload(c)
        run(prompts[: min(c, 2)])  # warm-up
        rates = []
        for _ in range(SHORT_RUNS if c <= FEW_REQUESTS else 1):
            t = time.perf_counter()
            tokens = run(prompts)
            rates.append(c * OUTPUT_TOKENS / (time.perf_counter() - t))
        results["by_concurrency"][str(c)] = {
            "tokens_per_s": statistics.median(rates),
            "tokens": tokens,
        }
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, out)


if __name__ == "__main__":  # vLLM's engine process re-imports the main module
    main(sys.argv[1:])
