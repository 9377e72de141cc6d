"""Decode step time against context: DeepSeek-V3 (dense MLA) and DeepSeek-V3.2 (sparse attention)
on the engine, and V3.2 under ``transformers``; KV bytes per token of both.

Run: ``.venv/bin/python -m benchmarks.bench_sparse_attention [--reps 5] [--max-context 32768]``

Two tiny checkpoints written alike (``init_tiny``, bpe tokenizer, float32, same seed): V3, and V3.2
with DeepSeek's ``index_topk`` 2048 and an indexer of 4 heads of 16 (see :data:`INDEXER`). For every context ``L`` and
batch ``B`` the engine's cache holds ``B`` requests of ``L`` earlier tokens (random cache contents:
a decode step's cost does not depend on their values), and one decode step of ``B`` tokens is timed
— the whole step (embedding to final norm), its MLA attention (every layer's paged attention:
cache write, gather, attention, output projection) and, for V3.2, the indexer's scoring and top-k
(O(context) by design; timed apart from the MLA part it selects for). ``transformers``' V3.2 (eager, batch 1)
fills its cache with the same context in chunks, then one decode step is timed. Medians of
``--reps``; one thread per process, as the engine's CI machine gives.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moeinfra.engine import attention as attention_module
from moeinfra.engine.checkpoint import CheckpointReader
from moeinfra.engine.hf_config import published_config, read_config
from moeinfra.engine.kv_cache import PagedKVCache, StepCache
from moeinfra.engine.models import deepseek_v3
from moeinfra.engine.registry import architecture
from moeinfra.engine.tiny import init_tiny
from moeinfra.eplb import rebalance
from moeinfra.moe.comm import Communicator
from moeinfra.moe.mla import Segment

BLOCK = 64
INDEX_TOPK = 2048
# DeepSeek's index_topk; 4 index heads of 16 so that the indexer's work per key (64 multiply-adds)
# against the tiny MLA's (4 heads x (40 + 32) = 288) is near DeepSeek-V3.2's (64 x 128 = 8,192
# against 128 x (576 + 512) = 139,264): the tiny default (16 x 32) would make the indexer dearer
# than the attention it saves.
INDEXER = {"index_topk": INDEX_TOPK, "index_n_heads": 4, "index_head_dim": 16}


def _model(path: Path):
    raw = read_config(path)
    arch = architecture(raw["model_type"])
    config = arch.parse_config(raw, "config.json")
    experts = config.block.num_routed_experts
    plan = rebalance(
        np.ones((config.num_moe_layers, experts)), experts, config.block.num_expert_groups, 1, 1
    )
    return arch, config, arch.load(CheckpointReader(path), config, plan, Communicator())


class _Clock:
    """Wraps ``owner.name`` (a function) to add up the seconds its calls take."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name
        self.inner = getattr(owner, name)
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out

    def __enter__(self):
        setattr(self.owner, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.inner)


def engine_step(path: Path, context: int, batch: int, reps: int) -> tuple[float, float, float]:
    """Median ``(step_s, mla_s, indexer_s)`` of one decode step of ``batch`` requests at
    ``context``: the whole step, its MLA attention, the indexer's scoring and top-k."""
    arch, config, model = _model(path)
    blocks_per_seq = -(-(context + 1) // BLOCK)
    cache = PagedKVCache(arch.kv_layout(config, torch.float32), blocks_per_seq * batch, BLOCK)
    torch.manual_seed(0)
    cache.data.normal_()
    slots = {
        b: StepCache.slots_of(list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)), BLOCK)
        for b in range(batch)
    }
    segments = [Segment(b, context, 1) for b in range(batch)]
    ids = torch.arange(3, 3 + batch)
    steps, mla, index = [], [], []
    with (
        _Clock(deepseek_v3, "paged_mla_attention") as attention,
        _Clock(attention_module, "select_tokens") as indexer,
    ):
        for _ in range(reps + 1):  # the first warms up
            attention.seconds = indexer.seconds = 0.0
            start = time.perf_counter()
            model(ids, segments, StepCache(cache, slots), "none")
            steps.append(time.perf_counter() - start)
            mla.append(attention.seconds - indexer.seconds)
            index.append(indexer.seconds)
    return tuple(statistics.median(x[1:]) for x in (steps, mla, index))


def transformers_step(path: Path, context: int, reps: int, chunk: int = 512) -> float:
    """Median seconds of one decode step of ``transformers``' model (batch 1) after ``context``
    tokens, its cache filled chunk by chunk."""
    import transformers
    from transformers import DynamicCache

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    ids = torch.randint(
        3, 1000, (1, context + reps + 1), generator=torch.Generator().manual_seed(0)
    )
    times = []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        for start in range(0, context, chunk):
            model(ids[:, start : min(start + chunk, context)], cache=cache, use_cache=True)
        for i in range(reps + 1):
            begin = time.perf_counter()
            model(ids[:, context + i : context + i + 1], cache=cache, use_cache=True)
            times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def kv_bytes() -> list[tuple[str, int]]:
    rows = []
    for name in ("deepseek-v3", "deepseek-v3.2-exp"):
        raw = published_config(name)
        arch = architecture(raw["model_type"])
        layout = arch.kv_layout(arch.parse_config(raw, name), torch.bfloat16)
        rows.append((name, layout.bytes_per_token))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--max-transformers-context", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    contexts = [c for c in (1024, 2048, 4096, 8192, 16384, 32768) if c <= args.max_context]
    with tempfile.TemporaryDirectory() as tmp:
        v3 = init_tiny(Path(tmp) / "v3", tokenizer="bpe")
        v32 = init_tiny(Path(tmp) / "v32", tokenizer="bpe", arch="deepseek_v32", config=INDEXER)
        print(f"V3.2 indexer {INDEXER}; float32, 1 thread; median of {args.reps} steps (ms)\n")
        print("| context | batch | V3 step | V3 MLA | V3.2 step | V3.2 MLA | V3.2 indexer "
              "| transformers V3.2 step |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for context in contexts:
            for batch in (1, 8):
                a_step, a_mla, _ = engine_step(v3, context, batch, args.reps)
                b_step, b_mla, b_index = engine_step(v32, context, batch, args.reps)
                hf = "—"
                if batch == 1 and context <= args.max_transformers_context:
                    hf = f"{transformers_step(v32, context, args.reps) * 1e3:,.1f}"
                ms = [f"{t * 1e3:,.2f}" for t in (a_step, a_mla, b_step, b_mla, b_index)]
                print(f"| {context:,} | {batch} | {' | '.join(ms)} | {hf} |", flush=True)
    print("\nKV cache per token (all layers, bf16, DeepSeek's published configs):\n")
    print("| model | bytes per token |")
    print("|---|---|")
    for name, size in kv_bytes():
        print(f"| {name} | {size:,} |")


if __name__ == "__main__":
    main()
