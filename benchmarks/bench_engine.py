"""Inference engine on the built-in tiny DeepSeek-V3 checkpoint (DeepSeek-V3 tokenizer, 129,280 vocab).

Run: ``.venv/bin/python -m benchmarks.bench_engine [--reps 3]``

1. Decode and prefill tokens/s against batch size, from the engine's own per-step timings (one rank):
   decode = tokens of pure decode steps / their time; prefill = prompt tokens / time of the steps
   that ran them (128-token prompts, one step for the whole batch). Engine overhead = step time
   outside the model's forward and the LM head + sampling (scheduling, inputs, outputs,
   detokenisation), as a share of the step, median over decode steps.
2. Side by side with ``transformers``' batched ``generate`` (same checkpoint, same token ids, greedy,
   EOS ignored) at 1, 8 and 32 concurrent requests: ``4 x concurrency`` requests (at least 8) with
   prompts of 16-128 tokens and 8-128 output tokens (seeded). The engine keeps ``concurrency``
   requests running and admits the next as one finishes (``max_num_seqs``); ``generate`` runs them
   in arrival-order batches of ``concurrency``, each left-padded and run until its longest output.
   Output tokens/s counts the tokens each request asked for, in both.
3. EP=2 (two spawned gloo ranks, one thread each) vs EP=1 (in-process, torch's default threads).
4. Dual micro-batch overlap on 2 ranks with an injected all-to-all latency per exchange, on a
   decode workload (64 requests x 32 tokens) and a prefill workload (16 prompts of 512 tokens).
Medians over ``--reps`` repetitions. Prefix caching is off throughout (the repetitions send the
same prompts, which would otherwise hit the cache from the second one on).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeinfra.engine import LLM, SamplingParams, default_model, init_tiny


def _prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    text = " ".join(f"request {i} asks how expert parallelism moves tokens" for i in range(64))
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    return [[0, *ids[i % 97 : i % 97 + length - 1]] for i in range(n)]


def engine_scaling(llm: LLM, batches: list[int], reps: int) -> list[dict]:
    rows = []
    for batch in batches:
        decode, prefill, overhead, step, head = [], [], [], [], []
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
            step.append(statistics.median(s.total_s for s in dec) * 1e3)
            head.append(statistics.median(s.sample_s for s in dec) * 1e3)
        rows.append(
            {
                "batch": batch,
                "decode": statistics.median(decode),
                "prefill": statistics.median(prefill),
                "overhead": statistics.median(overhead),
                "step_ms": statistics.median(step),
                "head_ms": statistics.median(head),
            }
        )
    return rows


def mixed_workload(llm: LLM, n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts of 16-128 tokens and their output lengths, 8-128 tokens."""
    rng = random.Random(seed)
    prompts = [_prompts(llm, 1, rng.randint(16, 128))[0] for _ in range(n)]
    return prompts, [rng.randint(8, 128) for _ in range(n)]


def hf_generate(model, prompts: list[list[int]], lengths: list[int], concurrency: int) -> float:
    pad = 2  # <｜▁pad▁｜>
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = prompts[i : i + concurrency]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        new = max(lengths[i : i + concurrency])
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
    return sum(lengths) / (time.perf_counter() - start)


def engine_generate(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in out] == lengths
    return sum(lengths) / elapsed


def versus_transformers(model_dir, reps: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rows = []
    for conc in (1, 8, 32):
        llm = LLM(model_dir, max_num_seqs=conc, num_kv_blocks=1024, enable_prefix_caching=False)
        prompts, lengths = mixed_workload(llm, max(8, 4 * conc))
        ours, theirs = [], []
        for _ in range(reps):
            ours.append(engine_generate(llm, prompts, lengths))
            theirs.append(hf_generate(hf, prompts, lengths, conc))
        llm.shutdown()
        rows.append(
            {
                "concurrency": conc,
                "engine": statistics.median(ours),
                "hf": statistics.median(theirs),
            }
        )
    return rows


def _time_unit(model_dir, reps: int, **options) -> dict[str, float]:
    """Median seconds of a decode workload (64 requests x 32 tokens) and a prefill workload
    (16 prompts of 512 tokens, 1 output token; 4,096 tokens per rank per step) on one unit."""
    with LLM(model_dir, max_num_batched_tokens=4096, enable_prefix_caching=False, **options) as llm:
        decode = _prompts(llm, 64, 16)
        prefill = [[0] + list(range(1000 + 7 * i, 1511 + 7 * i)) for i in range(16)]
        times: dict[str, list[float]] = {"decode": [], "prefill": []}
        for _ in range(reps):
            for kind, prompts, new in (("decode", decode, 32), ("prefill", prefill, 1)):
                start = time.perf_counter()
                llm.generate(
                    prompts,
                    SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                    use_tqdm=False,
                )
                times[kind].append(time.perf_counter() - start)
    return {kind: statistics.median(v) for kind, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[2.0, 5.0])
    parser.add_argument("--scaling-only", action="store_true", help="only the batch-size table")
    args = parser.parse_args(argv)
    model_dir = default_model()
    llm = LLM(
        model_dir,
        max_num_seqs=256,
        max_num_batched_tokens=32768,
        num_kv_blocks=1024,
        enable_prefix_caching=False,
    )
    print(
        f"checkpoint {model_dir}, float32, torch threads {torch.get_num_threads()}, "
        f"medians of {args.reps}\n"
    )
    print(
        "| batch | decode tok/s | prefill tok/s | decode step (ms) | of which LM head + sampling "
        "(ms) | engine overhead |"
    )
    print("|---|---|---|---|---|---|")
    for r in engine_scaling(llm, args.batches, args.reps):
        print(
            f"| {r['batch']} | {r['decode']:,.0f} | {r['prefill']:,.0f} | {r['step_ms']:.1f} | "
            f"{r['head_ms']:.1f} | {r['overhead']:.1%} |"
        )
    if args.scaling_only:
        return
    with tempfile.TemporaryDirectory() as tmp:
        bpe_dir = init_tiny(Path(tmp) / "tiny-bpe", tokenizer="bpe")
        for name, path in (
            ("DeepSeek-V3 tokenizer, vocab 129,280", model_dir),
            ("trained BPE, vocab 1,024", bpe_dir),
        ):
            print(f"\n{name}\n")
            print("| concurrent requests | engine tok/s | transformers tok/s | ratio |")
            print("|---|---|---|---|")
            for r in versus_transformers(path, args.reps):
                print(
                    f"| {r['concurrency']} | {r['engine']:,.0f} | {r['hf']:,.0f} | "
                    f"{r['engine'] / r['hf']:.2f}x |"
                )
    llm.shutdown()
    print("\n| unit | decode: 64 req x 32 tok (s) | prefill: 16 x 512-token prompts (s) |")
    print("|---|---|---|")
    for name, options in (
        ("EP=1, in-process", {"ranks": 1}),
        ("EP=2, no overlap", {"ranks": 2, "overlap": "none"}),
        ("EP=2, dual micro-batch overlap", {"ranks": 2, "overlap": "auto"}),
    ):
        t = _time_unit(model_dir, args.reps, **options)
        print(f"| {name} | {t['decode']:.2f} | {t['prefill']:.2f} |")
    print(
        "\n| injected latency per exchange | decode: none / overlap (s) | speed-up | "
        "prefill: none / overlap (s) | speed-up |"
    )
    print("|---|---|---|---|---|")
    for delay_ms in args.delays_ms:
        t = {
            mode: _time_unit(
                model_dir, args.reps, ranks=2, overlap=mode, comm_delay_s=delay_ms / 1e3
            )
            for mode in ("none", "auto")
        }
        print(
            f"| {delay_ms:g} ms | {t['none']['decode']:.2f} / {t['auto']['decode']:.2f} | "
            f"{t['none']['decode'] / t['auto']['decode']:.2f}x | "
            f"{t['none']['prefill']:.2f} / {t['auto']['prefill']:.2f} | "
            f"{t['none']['prefill'] / t['auto']['prefill']:.2f}x |"
        )


if __name__ == "__main__":
    main()
