"""The engine on a GPU: a ~1.2B-parameter DeepSeek-V3-shaped checkpoint (random bf16 weights,
DeepSeek-V3's tokenizer), offline throughput against ``transformers`` and, where it is installed,
vLLM's GPU build, on the same card; the same checkpoint in DeepSeek's FP8 layout through the
engine's FP8 path. Run by ``tools/device_check.sh`` (not by CI: it needs a GPU).

Run: ``python -m benchmarks.bench_gpu --out results.json`` (``--device cpu --shape small`` runs the
same code paths on the CPU in a minute, to check the script).

Workload per concurrency ``c``: ``c`` requests with prompts of 64-256 random tokens and 64 output
tokens each (greedy, EOS ignored), all submitted at once; output tokens/s = ``64 c`` / wall time.
Medians of ``--reps`` timed runs after one warm-up run. ``transformers`` runs each batch with left
padding in one ``generate`` call. Greedy agreement with ``transformers``: the share of requests
whose first 8 tokens are equal (bf16 on both sides, so near-ties may flip).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_vs_vllm import SMALL
from benchmarks.offline_worker import OUTPUT_TOKENS, transformers_runner, workload

# ~1.2B parameters: 12 layers (1 dense, 11 MoE with 48 routed experts, top-6 in 8 groups, 1
# shared), DeepSeek-V3's MLA widths (kv_lora_rank 512 + rope 64) and vocabulary.
SHAPES = {
    "1b": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 48,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 6,
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
    "small": SMALL,  # the CPU benchmark's small model: checks this script in a minute
}


def parameters(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    return total


def run_moeinfra(path: Path, concurrency: list[int], reps: int, device: str, **options) -> dict:
    from moeinfra.engine import LLM, SamplingParams
    from moeinfra.engine.fp8 import fp8_kernel

    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    began = time.perf_counter()
    llm = LLM(
        path,
        device=device,
        enable_prefix_caching=False,
        max_num_seqs=max(concurrency),
        num_kv_blocks=2048,
        max_num_batched_tokens=8192,
        **options,
    )
    core = llm._core
    out = {"load_s": time.perf_counter() - began, "dtype": str(core.dtype), "by_concurrency": {}}
    for c in concurrency:
        prompts = workload(c)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (allocator, kernels)
        times, steps = [], []
        for _ in range(reps):
            core.stats.clear()
            sync(device)
            t = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            sync(device)
            times.append(time.perf_counter() - t)
            decode = [s for s in core.stats if not s.prefill_tokens]
            steps.append(statistics.median(s.total_s for s in decode) if decode else float("nan"))
        out["by_concurrency"][c] = {
            "tokens_per_s": c * OUTPUT_TOKENS / statistics.median(times),
            "decode_step_ms": statistics.median(steps) * 1e3,
            "tokens": [r.outputs[0].token_ids for r in results],
        }
    out["fp8_kernel"] = fp8_kernel(core.device)
    if core.device.type == "cuda":
        out["max_memory_gib"] = torch.cuda.max_memory_allocated(core.device) / 2**30
    llm.shutdown()
    del llm, core
    return out


def run_transformers(
    path: Path, concurrency: list[int], reps: int, device: str, dtype: torch.dtype | None = None
) -> dict:
    began = time.perf_counter()
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    run = transformers_runner(
        str(path), str(dtype).removeprefix("torch."), concurrency, device=device
    )
    out = {"load_s": time.perf_counter() - began, "by_concurrency": {}}
    for c in concurrency:
        prompts = workload(c)
        run(prompts)
        times = []
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            tokens = run(prompts)
            sync(device)
            times.append(time.perf_counter() - t)
        out["by_concurrency"][c] = {
            "tokens_per_s": c * OUTPUT_TOKENS / statistics.median(times),
            "tokens": tokens,
        }
    return out


def run_vllm(path: Path, concurrency: list[int], reps: int) -> dict:
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        return {"skipped": f"vllm is not installed here ({err.name or err})"}
    llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    out = {"by_concurrency": {}}
    for c in concurrency:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in workload(c)]
        llm.generate(prompts, params, use_tqdm=False)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out["by_concurrency"][c] = {
            "tokens_per_s": c * OUTPUT_TOKENS / statistics.median(times),
            "tokens": [list(r.outputs[0].token_ids) for r in results],
        }
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def agreement(a: dict, b: dict, first: int = 8) -> dict:
    """Per concurrency: share of requests whose first ``first`` greedy tokens agree."""
    out = {}
    for c, row in a["by_concurrency"].items():
        other = b.get("by_concurrency", {}).get(c)
        if other:
            same = [
                x[:first] == y[:first] for x, y in zip(row["tokens"], other["tokens"], strict=True)
            ]
            out[c] = sum(same) / len(same)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build") / "bench_gpu.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip what starts later")
    parser.add_argument(
        "--skip", nargs="*", default=[], help="moeinfra, transformers, vllm, float32, fp8"
    )
    parser.add_argument("--fp8-concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: skipped, torch sees no CUDA GPU (tools/device_check.sh runs it on one)")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    from moeinfra.engine.tiny import init_tiny

    report: dict = {"device": args.device, "shape": args.shape, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
        report["capability"] = list(torch.cuda.get_device_capability(0))
        report["cuda"] = torch.version.cuda
    root = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    t = time.perf_counter()
    path = init_tiny(root / "ckpt", config=SHAPES[args.shape], dtype=dtype, shards=4)
    report["checkpoint_s"] = time.perf_counter() - t
    report["parameters"] = parameters(path)
    print(f"checkpoint: {report['parameters'] / 1e9:.2f}B parameters", flush=True)

    def save() -> None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, args.out)

    def over_budget(what: str) -> bool:
        if time.perf_counter() - began > args.budget_s:
            report.setdefault("skipped", []).append(
                f"{what}: over the {args.budget_s:.0f} s budget"
            )
            return True
        return what in args.skip

    for name, run in (
        ("moeinfra", lambda: run_moeinfra(path, args.concurrency, args.reps, args.device)),
        (
            "transformers",
            lambda: run_transformers(path, args.concurrency, args.reps, args.device),
        ),
        ("vllm", lambda: run_vllm(path, args.concurrency, args.reps)),
    ):
        if over_budget(name):
            continue
        try:
            report[name] = run()
        except Exception as err:  # a peer that fails is recorded, the others still run
            report[name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        rows = report[name].get("by_concurrency", {})
        print(name, {c: round(r["tokens_per_s"], 1) for c, r in rows.items()}, flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        save()
    if "moeinfra" in report and "transformers" in report:
        report["greedy_agreement_with_transformers"] = agreement(
            report["moeinfra"], report["transformers"]
        )
    if not over_budget("float32"):
        # the same checkpoint in float32 on both sides: greedy tokens should agree (bfloat16's
        # rounding flips near-ties on a random-weight model)
        try:
            ours = run_moeinfra(path, [8], 1, args.device, dtype="float32")
            theirs = run_transformers(path, [8], 1, args.device, torch.float32)
            report["greedy_agreement_float32"] = agreement(ours, theirs)
            report["float32_tokens_per_s"] = {
                "moeinfra": ours["by_concurrency"][8]["tokens_per_s"],
                "transformers": theirs["by_concurrency"][8]["tokens_per_s"],
            }
        except Exception as err:
            report["greedy_agreement_float32"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        save()
    if not over_budget("fp8"):
        t = time.perf_counter()
        fp8 = init_tiny(root / "fp8", config=SHAPES[args.shape], dtype=dtype, fp8=True, shards=4)
        report["fp8_checkpoint_s"] = time.perf_counter() - t
        try:
            report["moeinfra_fp8"] = run_moeinfra(fp8, args.fp8_concurrency, 1, args.device)
        except Exception as err:
            report["moeinfra_fp8"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
    for name in ("moeinfra", "transformers", "vllm", "moeinfra_fp8"):
        for row in report.get(name, {}).get("by_concurrency", {}).values():
            row.pop("tokens", None)
    report["wall_s"] = time.perf_counter() - began
    save()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
