"""Inference engine on the built-in tiny DeepSeek-V3 checkpoint (DeepSeek-V3 tokenizer, 129,280 vocab).

Run: ``.venv/bin/python -m benchmarks.bench_engine [--reps 3]``

1. Decode and prefill tokens/s against batch size, from the engine's own per-step timings (one rank):
   decode = tokens of pure decode steps / their time; prefill = prompt tokens / time of the steps
   that ran them (128-token prompts, one step for the whole batch). Engine overhead = step time
   outside the model's forward and the LM head + sampling (scheduling, inputs, outputs,
   detokenisation), as a share of the step, median over decode steps.
2. Side by side with ``transformers``' batched ``generate`` (same checkpoint, same token ids, 64 new
   tokens each, greedy, EOS ignored): output tokens/s at 1, 8 and 32 concurrent requests.
3. EP=2 (two spawned gloo ranks, one thread each) vs EP=1 (in-process, torch's default threads).
4. Dual micro-batch overlap on 2 ranks with an injected all-to-all latency per exchange.
Medians over ``--reps`` repetitions, configurations interleaved within each repetition.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moeinfra.engine import LLM, SamplingParams, default_model

NEW_TOKENS = 64


def _prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    text = " ".join(f"request {i} asks how expert parallelism moves tokens" for i in range(64))
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    return [[0, *ids[i % 97 : i % 97 + length - 1]] for i in range(n)]


def engine_scaling(llm: LLM, batches: list[int], reps: int) -> list[dict]:
    rows = []
    for batch in batches:
        decode, prefill, overhead = [], [], []
        for _ in range(reps):
            core = llm._core
            core.stats.clear()
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            llm.generate(_prompts(llm, batch, 128), params, use_tqdm=False)
            steps = list(core.stats)
            dec = [s for s in steps if s.prefill_tokens == 0 and s.decode_tokens]
            pre = [s for s in steps if s.prefill_tokens]
            decode.append(sum(s.decode_tokens for s in dec) / sum(s.total_s for s in dec))
            prefill.append(sum(s.prefill_tokens for s in pre) / sum(s.total_s for s in pre))
            overhead.append(statistics.median(s.overhead_s / s.total_s for s in dec))
            step_ms = statistics.median(s.total_s for s in dec) * 1e3
        rows.append(
            {
                "batch": batch,
                "decode": statistics.median(decode),
                "prefill": statistics.median(prefill),
                "overhead": statistics.median(overhead),
                "step_ms": step_ms,
            }
        )
    return rows


def hf_generate(model, prompts: list[list[int]]) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return len(prompts) * NEW_TOKENS / (time.perf_counter() - start)


def engine_generate(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in out) / elapsed


def versus_transformers(llm: LLM, model_dir, reps: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rows = []
    for conc in (1, 8, 32):
        prompts = _prompts(llm, conc, 32)
        ours, theirs = [], []
        for _ in range(reps):
            ours.append(engine_generate(llm, prompts))
            theirs.append(hf_generate(hf, prompts))
        rows.append(
            {
                "concurrency": conc,
                "engine": statistics.median(ours),
                "hf": statistics.median(theirs),
            }
        )
    return rows


def ep_and_overlap(model_dir, reps: int, delay_ms: float) -> dict:
    units = {
        "ep1": LLM(model_dir, ranks=1),
        "ep2": LLM(model_dir, ranks=2, overlap="none"),
        "ep2-delay-none": LLM(model_dir, ranks=2, overlap="none", comm_delay_s=delay_ms / 1e3),
        "ep2-delay-overlap": LLM(model_dir, ranks=2, overlap="auto", comm_delay_s=delay_ms / 1e3),
    }
    try:
        decode = _prompts(units["ep1"], 64, 16)
        prefill = [p * 8 for p in _prompts(units["ep1"], 8, 32)]  # 256-token prompts
        times = {(name, kind): [] for name in units for kind in ("decode", "prefill")}
        for _ in range(reps):
            for name, llm in units.items():
                for kind, prompts, new in (("decode", decode, 32), ("prefill", prefill, 1)):
                    start = time.perf_counter()
                    llm.generate(
                        prompts,
                        SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                        use_tqdm=False,
                    )
                    times[name, kind].append(time.perf_counter() - start)
        return {key: statistics.median(v) for key, v in times.items()}
    finally:
        for llm in units.values():
            llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--delay-ms", type=float, default=3.0)
    args = parser.parse_args(argv)
    model_dir = default_model()
    llm = LLM(model_dir, max_num_seqs=256, max_num_batched_tokens=32768, num_kv_blocks=1024)
    print(
        f"checkpoint {model_dir}, float32, torch threads {torch.get_num_threads()}, "
        f"medians of {args.reps}\n"
    )
    print("| batch | decode tok/s | prefill tok/s | decode step (ms) | engine overhead |")
    print("|---|---|---|---|---|")
    for r in engine_scaling(llm, args.batches, args.reps):
        print(
            f"| {r['batch']} | {r['decode']:,.0f} | {r['prefill']:,.0f} | {r['step_ms']:.1f} | "
            f"{r['overhead']:.1%} |"
        )
    print("\n| concurrent requests | engine tok/s | transformers tok/s | ratio |")
    print("|---|---|---|---|")
    for r in versus_transformers(llm, model_dir, args.reps):
        print(
            f"| {r['concurrency']} | {r['engine']:,.0f} | {r['hf']:,.0f} | "
            f"{r['engine'] / r['hf']:.2f}x |"
        )
    llm.shutdown()
    t = ep_and_overlap(model_dir, args.reps, args.delay_ms)
    print(
        f"\n| unit | decode: 64 req x 32 tok (s) | prefill: 8 x 256-token prompts (s) |\n"
        f"|---|---|---|\n"
        f"| EP=1, in-process | {t['ep1', 'decode']:.2f} | {t['ep1', 'prefill']:.2f} |\n"
        f"| EP=2, no overlap | {t['ep2', 'decode']:.2f} | {t['ep2', 'prefill']:.2f} |\n"
        f"| EP=2, +{args.delay_ms:g} ms per exchange, no overlap | "
        f"{t['ep2-delay-none', 'decode']:.2f} | {t['ep2-delay-none', 'prefill']:.2f} |\n"
        f"| EP=2, +{args.delay_ms:g} ms per exchange, dual micro-batch overlap | "
        f"{t['ep2-delay-overlap', 'decode']:.2f} | {t['ep2-delay-overlap', 'prefill']:.2f} |"
    )
    for kind in ("decode", "prefill"):
        gain = t["ep2-delay-none", kind] / t["ep2-delay-overlap", kind]
        print(f"\noverlap speed-up with injected latency, {kind}: {gain:.2f}x")


if __name__ == "__main__":
    main()
