"""One system's offline runs for ``bench_vs_vllm`` in a process of its own: moeinfra's ``LLM``,
``transformers``' ``generate`` or vLLM's ``LLM`` (the last run by the vLLM venv's Python, so this
file imports nothing of moeinfra at module level).

``python benchmarks/offline_worker.py SYSTEM CHECKPOINT DTYPE OUT.json C [C ...]
[--max-prompt N] [--output-tokens N]``: for each concurrency ``C``, ``C`` requests of 64 to
``--max-prompt`` (256) random prompt tokens (seeded: every system gets the same ids) and
``--output-tokens`` (64) greedy output tokens with EOS ignored, submitted at once; one warm-up
run, then one timed run, or the median of :data:`SHORT_RUNS` where ``C`` is at most
:data:`FEW_REQUESTS` or the first run lasted under :data:`SHORT_RUN_S` (32 requests of 128 prompt
tokens took ~2 s, and single such runs of one system ranged 1,130-1,460 tokens/s on this shared
2-core machine). Writes ``{"by_concurrency": {C: {"tokens_per_s", "tokens", "cpu_mean",
"cpu_peak"}}, "cores", "cpu"}``: CPU use in % of one core of the process and its children (vLLM's engine runs
in a child) during the timed runs, mean and peak of 0.25 s samples, and the cores the process
may run on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time

import psutil

THREADS = int(os.environ.get("OMP_NUM_THREADS", "2"))
FEW_REQUESTS, SHORT_RUNS, SHORT_RUN_S = 8, 5, 5.0
OUTPUT_TOKENS = 64  # the default of --output-tokens
MAX_PROMPT = 256  # the default of --max-prompt


def workload(n: int, max_prompt: int = MAX_PROMPT, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 120_000) for _ in range(rng.randint(64, max_prompt))] for _ in range(n)
    ]


class CpuUse:
    """CPU use of this process and its children (in % of one core) while in the ``with`` block:
    ``mean`` over the block, ``peak`` of :data:`SAMPLE_S` intervals."""

    SAMPLE_S = 0.25

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.mean = self.peak = 0.0

    def _seconds(self) -> float:
        total = 0.0
        for p in [self.process, *self.process.children(recursive=True)]:
            try:
                times = p.cpu_times()
            except psutil.Error:  # exited meanwhile
                continue
            total += times.user + times.system
        return total

    def _sample(self) -> None:
        last = (time.perf_counter(), self._seconds())
        while not self._done.wait(self.SAMPLE_S):
            now = (time.perf_counter(), self._seconds())
            self.peak = max(self.peak, 100 * (now[1] - last[1]) / (now[0] - last[0]))
            last = now

    def __enter__(self) -> CpuUse:
        self._start = (time.perf_counter(), self._seconds())
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        wall, cpu = time.perf_counter() - self._start[0], self._seconds() - self._start[1]
        self.mean = 100 * cpu / wall
        self.peak = max(self.peak, self.mean)


def moeinfra_runner(
    path: str, dtype: str, concurrency: list[int], output_tokens: int, max_prompt: int
):
    from moeinfra.engine import LLM, SamplingParams

    # the KV cache sized for the largest batch (every request's prompt and output)
    blocks = max(concurrency) * (max_prompt + output_tokens + 63) // 64 + 8
    llm = LLM(
        path,
        dtype=dtype,
        device="cpu",
        enable_prefix_caching=False,
        max_num_seqs=max(concurrency),
        num_kv_blocks=max(blocks, 512),
    )
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)

    def run(prompts):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return run


def transformers_runner(
    path: str,
    dtype: str,
    concurrency: list[int],
    output_tokens: int = OUTPUT_TOKENS,
    max_prompt: int = MAX_PROMPT,
    device: str = "cpu",
):
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
                max_new_tokens=output_tokens,
                min_new_tokens=output_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, width:].tolist()

    return run


def vllm_runner(path: str, dtype: str, concurrency: list[int], output_tokens: int, max_prompt: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        path,
        dtype=dtype,
        max_num_seqs=max(concurrency),
        max_model_len=max(4096, max_prompt + output_tokens),
        enable_prefix_caching=False,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)

    def run(prompts):
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


RUNNERS = {"moeinfra": moeinfra_runner, "transformers": transformers_runner, "vllm": vllm_runner}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=list(RUNNERS))
    parser.add_argument("checkpoint")
    parser.add_argument("dtype")
    parser.add_argument("out")
    parser.add_argument("concurrency", type=int, nargs="+")
    parser.add_argument("--max-prompt", type=int, default=MAX_PROMPT)
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    began = time.perf_counter()
    n = args.output_tokens
    run = RUNNERS[args.system](args.checkpoint, args.dtype, args.concurrency, n, args.max_prompt)
    results = {
        "startup_s": time.perf_counter() - began,
        "cores": sorted(os.sched_getaffinity(0)),
        "by_concurrency": {},
    }
    for c in args.concurrency:
        prompts = workload(c, args.max_prompt)
        run(prompts[: min(c, 2)])  # warm-up
        rates, use, runs = [], [], 1
        while len(rates) < runs:
            t = time.perf_counter()
            with CpuUse() as cpu:
                tokens = run(prompts)
            seconds = time.perf_counter() - t
            rates.append(c * n / seconds)
            use.append(cpu)
            if len(rates) == 1 and (c <= FEW_REQUESTS or seconds < SHORT_RUN_S):
                runs = SHORT_RUNS
        results["by_concurrency"][str(c)] = {
            "tokens_per_s": statistics.median(rates),
            "tokens": tokens,
            "cpu_mean": statistics.median(u.mean for u in use),
            "cpu_peak": max(u.peak for u in use),
        }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, args.out)


if __name__ == "__main__":  # vLLM's engine process re-imports the main module
    main()
