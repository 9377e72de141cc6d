"""Decode step time and KV-cache bytes against context: DeepSeek-V3 (dense MLA), DeepSeek-V3.2
(MLA behind an indexer) and DeepSeek-V4 (window + compressed entries) on the engine, next to
``transformers``' V3.2 and V4.

Run: ``.venv/bin/python -m benchmarks.bench_sparse_attention [--reps 5] [--max-context 32768]
[--models v3,v32,v4]``

Three tiny checkpoints written alike (``init_tiny``, bpe tokenizer, float32, same seed, hidden 64,
4 heads, 16 experts): V3; V3.2 with DeepSeek's ``index_topk`` 2048 and an indexer of 4 heads of 16
(:data:`INDEXER`); V4 with one layer of each kind (window only, CSA, HCA), DeepSeek's
``sliding_window`` 128 and compress ratios 4 and 128, V4-Flash's ``index_topk`` 512, the same
small indexer and ``head_dim`` 128 (:data:`V4`). For every context ``L`` and batch ``B`` the
engine's cache holds ``B`` requests of ``L`` earlier tokens (random cache contents: a decode step's
cost does not depend on their values; V4's compressed entries are read from it, :func:`v4_reads`
checks how many), and decode steps of ``B`` tokens at positions ``L, L + 1, ...`` are timed — the
whole step (embedding to final norm) and its attention:

- V3, V3.2: "MLA", every layer's paged attention (cache write, gather, attention, output
  projection) less the V3.2 indexer's scoring and top-k ("indexer", O(context) by design);
- V4: "attention", every layer's ``V4AttentionLayer`` (query and window-key projections, the
  window and compressed entries' attention, output projection) less its compressed part
  (``_compressed`` for one request, ``_decode_compressed`` for a batch of them: "compressed", the
  new tokens' compressor projections, the entries of windows they complete, the gather of every
  compressed entry and index key, the indexer's scoring and top-k).

``transformers``' V3.2 and V4 (eager, batch 1) fill their caches with the same context in chunks,
then one decode step is timed; a larger context is skipped once the previous fill, doubled, would
pass ``--transformers-budget`` seconds. Medians of ``--reps``; one thread per process, as the
engine's CI machine gives. Then the KV cache per token and per request at each context of
DeepSeek's published configs: the engine's allocation (its :class:`KVLayout`, and V4's state
held per request) and DeepSeek's own layout (:meth:`moeinfra.serving.arch.Architecture.kv_bytes`,
:attr:`~moeinfra.serving.arch.Architecture.compressor_state_bytes`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeinfra.engine import attention as attention_module
from moeinfra.engine.checkpoint import CheckpointReader
from moeinfra.engine.hf_config import published_config, read_config
from moeinfra.engine.kv_cache import PagedKVCache, StepCache
from moeinfra.engine.models import deepseek_v3, deepseek_v4
from moeinfra.engine.registry import architecture
from moeinfra.engine.tiny import V4_CSA, V4_HCA, V4_SLIDING, init_tiny
from moeinfra.eplb import rebalance
from moeinfra.moe.comm import Communicator
from moeinfra.moe.mla import Segment
from moeinfra.serving.arch import Architecture

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
# DeepSeek's index_topk; 4 index heads of 16 so that the indexer's work per key (64 multiply-adds)
# against the tiny MLA's (4 heads x (40 + 32) = 288) is near DeepSeek-V3.2's (64 x 128 = 8,192
# against 128 x (576 + 512) = 139,264): the tiny default (16 x 32) would make the indexer dearer
# than the attention it saves.
INDEXER = {"index_topk": 2048, "index_n_heads": 4, "index_head_dim": 16}
# DeepSeek-V4 at the tiny V3's scale (hidden 64, 4 heads, 16 experts, 3 layers) with DeepSeek's
# window and ratios and one layer of each kind; V4-Flash's index_topk 512 and V3.2's bench indexer.
# head_dim 128, not the tiny 32: the engine caches each entry as 1/ratio slices over its window's
# tokens, so head_dim must be a multiple of 128 (HCA); RoPE on 16 of them, DeepSeek's 1/8. Work per
# entry: the attention's 4 heads x 2 x 128 = 1,024 multiply-adds, the indexer's 4 x 16 = 64.
V4 = {
    "num_hidden_layers": 3,
    "head_dim": 128,
    "qk_rope_head_dim": 16,
    "partial_rotary_factor": 0.125,
    "layer_types": [V4_SLIDING, V4_CSA, V4_HCA],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {V4_CSA: 4, V4_HCA: 128},
    "sliding_window": 128,
    "index_topk": 512,
    "index_n_heads": 4,
    "index_head_dim": 16,
}
# published configs whose KV bytes are tabled (engine.hf_config.PUBLISHED)
PUBLISHED = ("deepseek-v3", "deepseek-v3.2-exp", "deepseek-v4-flash", "deepseek-v4-pro")


@dataclass(frozen=True)
class Timed:
    """What to time of one model: the whole step, ``attention`` (a function's calls, added up
    over the layers) and the ``part`` of it reported apart (its seconds are taken out of
    ``attention``'s); ``owner.name`` names a module function or a class's method."""

    label: str
    arch: str
    config: dict | None
    attention: tuple[object, str]
    part: tuple[object, tuple[str, ...]]  # the owner and the names of what is timed apart
    columns: tuple[str, str, str]  # step, attention less part, part


MODELS = {
    "v3": Timed(
        "V3",
        "deepseek_v3",
        None,
        (deepseek_v3, "paged_mla_attention"),
        (attention_module, ("select_tokens",)),
        ("V3 step", "V3 MLA", ""),
    ),
    "v32": Timed(
        "V3.2",
        "deepseek_v32",
        INDEXER,
        (deepseek_v3, "paged_mla_attention"),
        (attention_module, ("select_tokens",)),
        ("V3.2 step", "V3.2 MLA", "V3.2 indexer"),
    ),
    "v4": Timed(
        "V4",
        "deepseek_v4",
        V4,
        (deepseek_v4.V4AttentionLayer, "forward"),
        (deepseek_v4.V4AttentionLayer, ("_compressed", "_decode_compressed")),  # 1 / B requests
        ("V4 step", "V4 attention", "V4 compressed"),
    ),
}
# transformers' model of these is timed at batch 1 (V3's is the same dense MLA the engine checks)
TRANSFORMERS = ("v32", "v4")


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
    """Replaces ``owner.name`` (a function or a method) by one that adds up the seconds its calls
    take and, given ``inspect``, keeps ``inspect(args, out)`` of every call in ``seen``."""

    def __init__(self, owner, name: str, inspect=None) -> None:
        self.owner, self.name, self.inspect = owner, name, inspect
        self.inner = getattr(owner, name)
        self.seconds = 0.0
        self.seen: list = []

    def __enter__(self):
        inner, clock = self.inner, self

        def timed(*args, **kwargs):  # a plain function: bound as a method when owner is a class
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            clock.seconds += time.perf_counter() - start
            if clock.inspect is not None:
                clock.seen.append(clock.inspect(args, out))
            return out

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.inner)


def _filled_cache(arch, config, context: int, batch: int, steps: int = 1) -> StepCache:
    """A paged cache holding ``batch`` requests of ``context`` random earlier tokens, with room
    for ``steps`` decode steps each."""
    block = arch.block_size(config)
    blocks_per_seq = -(-(context + steps) // block)
    layout = arch.kv_layout(config, torch.float32, block)
    cache = PagedKVCache(layout, blocks_per_seq * batch, block)
    torch.manual_seed(0)
    cache.data.normal_()
    slots = {
        b: StepCache.slots_of(list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)), block)
        for b in range(batch)
    }
    return StepCache(cache, slots)


def engine_step(path: Path, timed: Timed, context: int, batch: int, reps: int):
    """Median ``(step_s, attention_s, part_s)`` of a decode step of ``batch`` requests after
    ``context`` tokens (``attention_s`` less ``part_s``; see :class:`Timed`): ``reps + 1``
    consecutive steps (positions ``context, context + 1, ...``), the first a warm-up."""
    arch, config, model = _model(path)
    filled = _filled_cache(arch, config, context, batch, reps + 1)
    ids = torch.arange(3, 3 + batch)
    steps, attention, part = [], [], []
    owner, names = timed.part
    with _Clock(*timed.attention) as whole, contextlib.ExitStack() as stack:
        inner = [stack.enter_context(_Clock(owner, n)) for n in names]
        for i in range(reps + 1):
            segments = [Segment(b, context + i, 1) for b in range(batch)]
            for clock in (whole, *inner):
                clock.seconds = 0.0
            start = time.perf_counter()
            model(ids, segments, StepCache(filled.cache, filled.slots), "none")
            steps.append(time.perf_counter() - start)
            part_s = sum(clock.seconds for clock in inner)
            attention.append(whole.seconds - part_s)
            part.append(part_s)
    return tuple(statistics.median(x[1:]) for x in (steps, attention, part))


def v4_reads(path: Path, context: int) -> dict[str, tuple[int, int]]:
    """``{layer kind: (compressed entries read, entries attended)}`` of one V4 decode step after
    ``context`` tokens, as the engine's step reads them from the cache; raises unless they are
    what DeepSeek-V4 attends to (:meth:`Architecture.attended_entries`)."""
    arch, config, model = _model(path)
    step = _filled_cache(arch, config, context, 1)

    def entries(args, out):
        # (entries, visible, ...): shared [E, hd] entries, or each decode query's top-k [1, k, hd]
        layer, found, visible = args[0], out[0], out[1]
        return layer.kind, found.shape[-2], int(visible.sum(-1).max())

    with _Clock(deepseek_v4.V4AttentionLayer, "_compressed", entries) as probe:
        model(torch.tensor([3]), [Segment(0, context, 1)], step, "none")
    formula = Architecture.from_config(read_config(path), "tiny V4")
    reads = {kind: (found, attended) for kind, found, attended in probe.seen}
    for layer, kind in enumerate(config.v4.layer_kinds):
        if kind == deepseek_v4.SLIDING:
            continue
        expected = formula.attended_entries(layer, context + 1)[1]
        found, attended = reads[kind]
        # a CSA decode query gathers its top-k entries only, an HCA one every entry
        whole = (context + 1) // config.v4.compress_ratios[layer]
        if attended != expected or found != (expected if kind == deepseek_v4.CSA else whole):
            raise AssertionError(
                f"{kind} at {context}: read {found}, attended {attended}; expected {expected}"
            )
    return reads


def transformers_step(path: Path, context: int, reps: int, chunk: int = 512):
    """``(median step_s, fill_s)``: one decode step of ``transformers``' model (batch 1) after
    ``context`` tokens, and the time to fill its cache chunk by chunk."""
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
        begin = time.perf_counter()
        for start in range(0, context, chunk):
            model(ids[:, start : min(start + chunk, context)], cache=cache, use_cache=True)
        fill = time.perf_counter() - begin
        for i in range(reps + 1):
            begin = time.perf_counter()
            model(ids[:, context + i : context + i + 1], cache=cache, use_cache=True)
            times.append(time.perf_counter() - begin)
    return statistics.median(times[1:]), fill


@dataclass(frozen=True)
class KVRow:
    """One published model's KV cache in bf16: the engine's allocation per token (a constant, at
    the least block size holding whole V4 windows) and the most bytes a V4 request holds outside
    it (open windows' compressor projections); DeepSeek's layout per request at each context, in
    bf16 and fp8 (``{context: bytes}``), and its compressor state per request."""

    name: str
    engine_per_token: int
    engine_state: int
    deepseek_bf16: dict[int, int]
    deepseek_fp8: dict[int, int]
    deepseek_state: int


def kv_bytes(contexts=CONTEXTS) -> list[KVRow]:
    rows = []
    for name in PUBLISHED:
        raw = published_config(name)
        arch = architecture(raw["model_type"])
        config = arch.parse_config(raw, name)
        layout = arch.kv_layout(config, torch.bfloat16, arch.block_size(config))
        state = deepseek_v4.state_bytes_per_request(config, torch.bfloat16) if config.v4 else 0
        formula = Architecture.from_config(raw, name)
        rows.append(
            KVRow(
                name,
                layout.bytes_per_token,
                state,
                {c: formula.kv_bytes(c, "bf16") for c in contexts},
                {c: formula.kv_bytes(c, "fp8") for c in contexts},
                formula.compressor_state_bytes,
            )
        )
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def _print_kv(contexts) -> None:
    heads = " | ".join(f"{c // 1024}K" for c in contexts)
    print("\nKV cache bytes per token (all layers) of DeepSeek's published configs: the engine's")
    print("allocation (bf16, any context) and DeepSeek's layout at each context (bf16 / fp8):\n")
    print(f"| model | engine | {heads} |")
    print(f"|---|---|{'---|' * len(contexts)}")
    rows = kv_bytes(contexts)
    for r in rows:
        cells = " | ".join(
            f"{r.deepseek_bf16[c] / c:,.0f} / {r.deepseek_fp8[c] / c:,.0f}" for c in contexts
        )
        print(f"| {r.name} | {r.engine_per_token:,} | {cells} |")
    print("\nPer request (MiB, bf16): the engine's cache / DeepSeek's layout; V4's compressor")
    print("state besides (engine: bf16 projections held per request; DeepSeek's: float32):\n")
    print(f"| model | state | {heads} |")
    print(f"|---|---|{'---|' * len(contexts)}")
    mib = 2**20
    for r in rows:
        cells = " | ".join(
            f"{r.engine_per_token * c / mib:,.1f} / {r.deepseek_bf16[c] / mib:,.1f}"
            for c in contexts
        )
        state = f"{r.engine_state / mib:,.1f} / {r.deepseek_state / mib:,.1f}"
        print(f"| {r.name} | {state if r.deepseek_state else '—'} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--max-transformers-context", type=int, default=16384)
    parser.add_argument(
        "--transformers-budget",
        type=float,
        default=240.0,
        help="skip transformers' next context once twice its last cache fill passes this (s)",
    )
    parser.add_argument("--models", default="v3,v32,v4", help=f"of {','.join(MODELS)}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    contexts = [c for c in CONTEXTS if c <= args.max_context]
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models: {unknown[0]!r} is not one of {', '.join(MODELS)}")
    fill = dict.fromkeys(TRANSFORMERS, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            n: init_tiny(
                Path(tmp) / n, tokenizer="bpe", arch=MODELS[n].arch, config=MODELS[n].config
            )
            for n in names
        }
        print(f"float32, 1 thread; milliseconds, medians of {args.reps} steps")
        heads = [c for n in names for c in MODELS[n].columns if c]
        heads += [f"transformers {MODELS[n].label} step" for n in TRANSFORMERS if n in names]
        print(f"\n| context | batch | {' | '.join(heads)} |")
        print(f"|---|---|{'---|' * len(heads)}")
        for context in contexts:
            for batch in (1, 8):
                cells = []
                for n in names:
                    times = engine_step(paths[n], MODELS[n], context, batch, args.reps)
                    cells += [_ms(t) for t, c in zip(times, MODELS[n].columns, strict=True) if c]
                for n in (n for n in TRANSFORMERS if n in names):
                    cell = "—"
                    if batch == 1 and context <= args.max_transformers_context:
                        if 2 * fill[n] > args.transformers_budget:
                            cell = "skipped"
                        else:
                            step, fill[n] = transformers_step(paths[n], context, args.reps)
                            cell = f"{step * 1e3:,.1f}"
                    cells.append(cell)
                print(f"| {context:,} | {batch} | {' | '.join(cells)} |", flush=True)
        if "v4" in names:
            print("\nV4 compressed entries a decode step reads / attends per query (checked):\n")
            print("| context | CSA read | CSA attended | HCA read |")
            print("|---|---|---|---|")
            for context in contexts:
                reads = v4_reads(paths["v4"], context)
                csa, hca = reads[deepseek_v4.CSA], reads[deepseek_v4.HCA]
                print(f"| {context:,} | {csa[0]:,} | {csa[1]:,} | {hca[0]:,} |")
    if any(fill.values()):
        took = ", ".join(f"{MODELS[n].label} {s:,.0f} s" for n, s in fill.items() if s)
        print(f"\ntransformers' last cache fill (batch 1, 512-token chunks): {took}")
    _print_kv(contexts)


if __name__ == "__main__":
    main()
