"""The serving stack's own cost: per-token overhead against the engine alone, its ceiling with a
no-op model, and the KV bytes a hand-off moves per token.

1. Overhead at the same batch: ``B`` requests (64-token prompts, 64 greedy output tokens, EOS
   ignored) on the engine alone (``LLM``, one rank, in-process: median pure-decode step at batch
   ``B``, one thread as a unit rank) and through the server (``serve up``, one prefill and one decode unit of one rank each,
   the same engine options; all ``B`` requests sent at once as streams); each the median of three
   repetitions. The server's time per output token is read at three places: the decode unit's
   step (rank loop included), the API server (its own TPOT histogram: tokens reaching it from the
   router) and the client (after the streamed events are parsed; the client shares the two cores).
   Overhead = TPOT / engine step - 1: API server, router, ZeroMQ and the rank's loop (at the API),
   plus the streamed events and their parsing (at the client).
2. Ceiling: the default units (1 prefill + 1 decode of 2 ranks) with ``--noop-model`` (the forward
   and LM head return zeros; sampling, detokenisation, hand-off and streaming still run), 64
   concurrent streams of 256 tokens, three times: median streamed tokens/s at the client, and per
   core of this machine; with the default checkpoint's 129,280-entry vocabulary (greedy sampling
   is an argmax over it) and with the 512-entry test tokenizer (the stack without that).
3. KV hand-off bytes per prompt token (``moeinfra:kv_transfer_sent_bytes`` over the prompt tokens
   handed off) against the MLA formula layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes.

One run each; the default checkpoint (DeepSeek-V3 tokenizer, 129,280-entry vocabulary).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path

import httpx
import torch

from moeinfra.engine import LLM, SamplingParams, default_model, init_tiny
from moeinfra.server import bench as b
from moeinfra.server.process import ServerProcess

ENGINE = {"block_size": 16, "num_kv_blocks": 1024, "max_num_seqs": 64}
FLAGS = ["--block-size", "16", "--num-kv-blocks", "1024", "--max-num-seqs", "64"]
ONE_RANK = ["--prefill-ranks", "1", "--decode-ranks", "1"]
REPS = 3


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [b.token_block(seed * 10_000 + i, length, 1000) for i in range(n)]


def engine_step_s(batch: int, reps: int) -> float:
    torch.set_num_threads(1)  # as each unit rank runs
    llm = LLM(default_model(), ranks=1, enable_prefix_caching=False, **ENGINE)
    core = llm._core
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts(batch, 64, 1), params, use_tqdm=False)  # warm-up
    medians = []
    for rep in range(reps):
        core.stats.clear()
        llm.generate(prompts(batch, 64, 2 + rep), params, use_tqdm=False)
        steps = [s.total_s for s in core.stats if s.decode_tokens == batch and not s.prefill_tokens]
        medians.append(statistics.median(steps))
    return statistics.median(medians)


def server_tpot_s(server: ServerProcess, batch: int, seed: int, reps: int) -> dict[str, float]:
    """Medians over ``reps`` batches of: the decode unit's step at this batch (its rank loop
    included, ``GET /calibration/steps``), the API server's mean time per output token (its own
    histogram: when tokens reach it, before the client parses them) and the client's."""
    unit, api, client = [], [], []
    for rep in range(reps):
        requests = [b.BenchRequest(0.0, p, 64) for p in prompts(batch, 64, seed + 100 * rep)]
        before = api_tpot_totals(server.url)
        seen = decode_steps(server.url)
        results, _ = asyncio.run(b.replay(server.url, requests))
        after = api_tpot_totals(server.url)
        steps = [s for s in decode_steps(server.url) if s["step"] > max(seen, default=-1)]
        unit.append(statistics.median(s["seconds"] for s in steps if s["tokens"] == batch))
        api.append((after[0] - before[0]) / (after[1] - before[1]))
        client.append(statistics.median(r.tpot_s for r in results if r.tpot_s is not None))
    return {k: statistics.median(v) for k, v in (("unit", unit), ("api", api), ("client", client))}


def api_tpot_totals(url: str) -> tuple[float, float]:
    name = "moeinfra:time_per_output_token_seconds"
    return metric(url, f"{name}_sum"), metric(url, f"{name}_count")


def decode_steps(url: str) -> list[dict]:
    units = httpx.get(f"{url}/calibration/steps").json()["units"]
    return [s for u in units if u["role"] == "decode" for s in u["steps"] if s["phase"] == "decode"]


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32")
    opts = parser.parse_args()
    batches = [int(x) for x in opts.batches.split(",")]

    print(
        "| requests in the batch | engine step (ms) | unit step in the server (ms) | "
        "API TPOT (ms) | overhead at the API | client TPOT (ms) | overhead at the client |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    engine = {batch: engine_step_s(batch, REPS) for batch in batches}
    with ServerProcess([*ONE_RANK, *FLAGS]) as server:
        server_tpot_s(server, 2, 99, 1)  # warm-up
        for batch in batches:
            t = server_tpot_s(server, batch, 3 + batch, REPS)
            e = engine[batch]
            print(
                f"| {batch} | {e * 1e3:.2f} | {t['unit'] * 1e3:.2f} | {t['api'] * 1e3:.2f} | "
                f"{t['api'] / e - 1:+.0%} | {t['client'] * 1e3:.2f} | {t['client'] / e - 1:+.0%} |"
            )
        sent = metric(server.url, "moeinfra:kv_transfer_sent_bytes")
        prompt_tokens = metric(server.url, "moeinfra:prompt_tokens_total")

    cfg = json.loads((default_model() / "config.json").read_text())
    layers, latent = cfg["num_hidden_layers"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    print(
        f"\nKV hand-off: {sent / prompt_tokens:.1f} bytes per prompt token "
        f"({sent:,.0f} bytes for {prompt_tokens:,.0f} tokens); MLA formula "
        f"{layers} x {latent} x 4 B = {layers * latent * 4} (float32); "
        "DeepSeek-V3 in BF16: 61 x 576 x 2 B = 70,272"
    )

    cores = os.cpu_count() or 1
    print("\n| model (vocabulary) | streamed tokens/s (median of 3) | per core | errors |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        small = init_tiny(Path(tmp) / "tiny-bpe", tokenizer="bpe")
        for label, model in (
            ("tiny, DeepSeek-V3 tokenizer (129,280)", default_model()),
            ("tiny, test tokenizer (512)", small),
        ):
            rates, errors = [], 0
            with ServerProcess(["--model", str(model), *FLAGS, "--noop-model"]) as server:
                warm = [b.BenchRequest(0.0, p, 16) for p in prompts(8, 64, 7)]
                asyncio.run(b.replay(server.url, warm))
                for rep in range(3):
                    requests = [b.BenchRequest(0.0, p, 256) for p in prompts(64, 64, 20 + rep)]
                    results, wall = asyncio.run(b.replay(server.url, requests))
                    summary = b.summarize(results, wall)
                    rates.append(summary["throughput"]["output_tokens_per_s"])
                    errors += summary["errors"]
            rate = statistics.median(rates)
            print(f"| {label} | {rate:,.0f} | {rate / cores:,.0f} | {errors} |")


if __name__ == "__main__":
    main()
