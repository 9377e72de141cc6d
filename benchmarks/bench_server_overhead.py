"""The serving stack's own cost: per-token overhead against the engine alone, its ceiling with a
no-op model, and the KV bytes a hand-off moves per token.

1. Overhead at the same batch: ``B`` requests (64-token prompts, 64 greedy output tokens, EOS
   ignored) on the engine alone (``LLM``, one rank, in-process: median pure-decode step at batch
   ``B``) and through the server (``serve up``, one prefill and one decode unit of one rank each,
   the same engine options; all ``B`` requests sent at once as streams: median time per output
   token). Overhead = server TPOT / engine step - 1: API server, router, ZeroMQ, the rank's loop
   and the streamed events.
2. Ceiling: the same server with ``--noop-model`` (the forward and LM head return zeros; sampling,
   detokenisation, hand-off and streaming still run), 64 concurrent streams of 256 tokens: streamed
   tokens/s at the client, and per core of this machine.
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

import httpx

from moeinfra.engine import LLM, SamplingParams, default_model
from moeinfra.server import bench as b
from moeinfra.server.process import ServerProcess

ENGINE = {"block_size": 16, "num_kv_blocks": 1024, "max_num_seqs": 64}
FLAGS = ["--block-size", "16", "--num-kv-blocks", "1024", "--max-num-seqs", "64"]
ONE_RANK = ["--prefill-ranks", "1", "--decode-ranks", "1"]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [b.token_block(seed * 10_000 + i, length, 1000) for i in range(n)]


def engine_step_s(batch: int) -> float:
    llm = LLM(default_model(), ranks=1, enable_prefix_caching=False, **ENGINE)
    core = llm._core
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts(batch, 64, 1), params, use_tqdm=False)  # warm-up
    core.stats.clear()
    llm.generate(prompts(batch, 64, 2), params, use_tqdm=False)
    steps = [s.total_s for s in core.stats if s.decode_tokens == batch and not s.prefill_tokens]
    return statistics.median(steps)


def server_tpot_s(server: ServerProcess, batch: int, seed: int) -> float:
    requests = [b.BenchRequest(0.0, p, 64) for p in prompts(batch, 64, seed)]
    results, _ = asyncio.run(b.replay(server.url, requests))
    return statistics.median(r.tpot_s for r in results if r.tpot_s is not None)


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

    print("| requests in the batch | engine step (ms) | server TPOT p50 (ms) | overhead |")
    print("|---:|---:|---:|---:|")
    engine = {batch: engine_step_s(batch) for batch in batches}
    with ServerProcess([*ONE_RANK, *FLAGS]) as server:
        server_tpot_s(server, 2, 99)  # warm-up
        for batch in batches:
            tpot = server_tpot_s(server, batch, 3 + batch)
            print(
                f"| {batch} | {engine[batch] * 1e3:.2f} | {tpot * 1e3:.2f} | "
                f"{tpot / engine[batch] - 1:+.0%} |"
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

    with ServerProcess([*FLAGS, "--noop-model"]) as server:
        warm = [b.BenchRequest(0.0, p, 16) for p in prompts(8, 64, 7)]
        asyncio.run(b.replay(server.url, warm))
        requests = [b.BenchRequest(0.0, p, 256) for p in prompts(64, 64, 8)]
        results, wall = asyncio.run(b.replay(server.url, requests))
        summary = b.summarize(results, wall)
    rate = summary["throughput"]["output_tokens_per_s"]
    cores = os.cpu_count() or 1
    print(
        f"\nno-op model, 64 streams x 256 tokens (default units: 1 prefill + 1 decode of 2 ranks): "
        f"{rate:,.0f} streamed tokens/s = {rate / cores:,.0f} per core ({cores} cores), "
        f"{summary['errors']} errors"
    )


if __name__ == "__main__":
    main()
