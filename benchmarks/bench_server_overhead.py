"""The serving stack's own cost: per-token overhead against the engine alone, its ceiling with a
no-op model, and the KV bytes a hand-off moves per token.

1. Overhead at the same batch: ``B`` requests (64-token prompts, 64 greedy output tokens, EOS
   ignored) on the engine alone (``LLM``, one rank, in this process, one thread as a unit rank:
   median pure-decode step at batch ``B``) and through the server (``serve up``, one prefill and
   one decode unit of one rank each, the same engine options; all ``B`` requests sent at once as
   streams), in turns five times (the machine is shared: a slow spell hits both). Through the
   server: the decode unit's step at the full batch (rank loop included), and at the client the
   time per token while the whole batch decodes (after the last first token: the same batch as
   the engine's step, no prefill beside it) and the TPOT of whole requests (which also holds the
   decode steps that ran beside the batch's prefills on the same two cores). Overhead = the
   median over the five turns of server time per token / engine step - 1: API server, router,
   ZeroMQ, the rank's loop, the streamed events and their parsing (the client shares the cores).
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
import numpy as np
import torch

from moeinfra.engine import LLM, SamplingParams, default_model, init_tiny
from moeinfra.server import bench as b
from moeinfra.server.process import ServerProcess

ENGINE = {"block_size": 16, "num_kv_blocks": 1024, "max_num_seqs": 64}
FLAGS = ["--block-size", "16", "--num-kv-blocks", "1024", "--max-num-seqs", "64"]
ONE_RANK = ["--prefill-ranks", "1", "--decode-ranks", "1"]
REPS = 5


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [b.token_block(seed * 10_000 + i, length, 1000) for i in range(n)]


def engine_step_s(llm: LLM, batch: int, seed: int) -> float:
    """Median pure-decode step of the engine alone at ``batch`` requests."""
    core = llm._core
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    core.stats.clear()
    llm.generate(prompts(batch, 64, seed), params, use_tqdm=False)
    return statistics.median(
        s.total_s for s in core.stats if s.decode_tokens == batch and not s.prefill_tokens
    )


def server_tpot_s(server: ServerProcess, batch: int, seed: int) -> dict[str, float]:
    """One batch through the server: the decode unit's median step at the full batch (its rank
    loop included, ``GET /calibration/steps``), the client's time per token while the whole batch
    decodes (:func:`steady_tpot_s`) and the client's median TPOT over whole requests."""
    requests = [b.BenchRequest(0.0, p, 64) for p in prompts(batch, 64, seed)]
    seen = max((s["step"] for s in decode_steps(server.url)), default=-1)
    results, _ = asyncio.run(b.replay(server.url, requests))
    steps = [s for s in decode_steps(server.url) if s["step"] > seen]
    return {
        "unit": statistics.median(s["seconds"] for s in steps if s["tokens"] == batch),
        "steady": steady_tpot_s(results),
        "whole": statistics.median(r.tpot_s for r in results if r.tpot_s is not None),
    }


def steady_tpot_s(results: list[b.BenchResult]) -> float:
    """Median over requests of the seconds per token they received while every request of the
    batch was decoding: after the last first token, up to the first request's last token (the
    engine-alone figure is the same: a decode step at the full batch, no prefill beside it)."""
    firsts = [r.arrival_s + r.ttft_s for r in results]
    times = [f + np.cumsum(r.itl_s) for f, r in zip(firsts, results, strict=True)]
    start, end = max(firsts), min(t[-1] for t in times)
    per_token = []
    for t in times:
        inside = t[(t > start) & (t <= end)]
        if inside.size >= 2:
            per_token.append((inside[-1] - inside[0]) / (inside.size - 1))
    return statistics.median(per_token)


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
        "server, whole batch decoding (ms) | overhead | server TPOT, whole requests (ms) | "
        "overhead |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    torch.set_num_threads(1)  # as each unit rank runs
    llm = LLM(default_model(), ranks=1, enable_prefix_caching=False, **ENGINE)
    with ServerProcess([*ONE_RANK, *FLAGS]) as server:
        engine_step_s(llm, 2, 1)  # warm-ups
        server_tpot_s(server, 2, 99)
        for batch in batches:
            # engine and server in turns, so that the shared machine's slow spells hit both
            engine, server_t = [], []
            for rep in range(REPS):
                engine.append(engine_step_s(llm, batch, 2 + 100 * rep))
                server_t.append(server_tpot_s(server, batch, 3 + batch + 100 * rep))
            e = statistics.median(engine)
            t = {k: statistics.median(r[k] for r in server_t) for k in server_t[0]}
            ratio = {
                k: statistics.median(r[k] / x for r, x in zip(server_t, engine, strict=True))
                for k in ("steady", "whole")
            }
            print(
                f"| {batch} | {e * 1e3:.2f} | {t['unit'] * 1e3:.2f} | {t['steady'] * 1e3:.2f} | "
                f"{ratio['steady'] - 1:+.0%} | {t['whole'] * 1e3:.2f} | {ratio['whole'] - 1:+.0%} |"
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
            layout = ["--prefill-units", "1", "--decode-units", "1"]  # the disaggregated system
            with ServerProcess(["--model", str(model), *layout, *FLAGS, "--noop-model"]) as server:
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
