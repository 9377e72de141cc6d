"""MLA attention over the paged latent cache (DeepSeek-V3's KV layout).

A step's tokens arrive as segments (a run of consecutive positions of one sequence). Their latents are
written to the sequence's cache slots first, then each query attends to every cached position up to its
own: decode segments (one token each) are batched into one padded gather in the absorbed form (on
the CPU mostly one fused kernel reading the cache's slots, :func:`moeinfra.moe.cpu_kernels`'
``mla_decode``, also for the decode rows of a step that carries prefill chunks); longer
segments (prefill chunks) are attended one by one, a long one with per-head keys and values expanded
from its context (:func:`expanded_attention`, cheaper than the absorbed form past
:func:`expanded_attention_threshold` queries; the prompts a step starts share those projections on
the CPU, :func:`_fresh_chunks_attention`). Which slots to write and gather depends only on the segments, so it
is worked out once per step and micro-batch (:class:`AttentionPlan`) and shared by every layer. The
math is :func:`moeinfra.moe.mla.latent_attention` (absorbed form).

With DeepSeek-V3.2's indexer (DeepSeek Sparse Attention), a query at position ``p >= topk`` attends
only to the ``topk`` cached entries the indexer selects for it (:mod:`moeinfra.engine.indexer`): those
rows gather ``topk`` entries each, however long the context; a query with at most ``topk`` earlier
tokens sees all of them, as in dense attention.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from moeinfra.engine.indexer import IndexQuery, select_tokens
from moeinfra.engine.kv_cache import KVLayout, LayerCache, StepCache, gather
from moeinfra.moe import cpu_features, cpu_kernels
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.mla import MLA, Latent, Segment, latent_attention, latent_query

LATENT, ROPE_KEY, INDEX_KEY = "kv", "k_pe", "index_k"


def mla_layout(
    block: MoEConfig, num_layers: int, dtype: torch.dtype, index_head_dim: int = 0
) -> KVLayout:
    """Per token per layer: the normalised latent and the rotated shared key, then (DeepSeek-V3.2)
    the indexer's key of ``index_head_dim``."""
    parts = ((LATENT, block.kv_lora_rank), (ROPE_KEY, block.qk_rope_head_dim))
    if index_head_dim:
        parts += ((INDEX_KEY, index_head_dim),)
    return KVLayout(parts, num_layers, dtype)


@dataclass
class AttentionPlan:
    """Slots of one micro-batch's tokens: ``write [T]``; decode rows ``decode_rows [D]`` gathering
    the first ``decode_lengths [D]`` of ``decode_slots [D, L]``, where ``decode_mask [D, 1, L]``
    (None when every context is ``L`` long);
    per prefill chunk ``(rows [n], context slots [m], mask [1, n, m])``. With a dense limit
    (``topk``), rows at positions ``>= topk`` are ``sparse`` instead: ``(rows [n], context slots
    [m] or [n, m], mask [n, m])`` for the indexer to choose from. Chunks of at most
    :data:`SHORT_CHUNK` tokens (draft verification, short prompts) are ``short``: per length ``n``,
    ``(rows [S * n], context slots [S, L], mask [S, n, L])`` attended in one batch. On the cache's
    device."""

    num_tokens: int
    write: torch.Tensor
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    decode_lengths: torch.Tensor
    decode_mask: torch.Tensor | None
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    sparse: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    short: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


def plan_attention(
    step: StepCache, segments: list[Segment], dense_below: int | None = None
) -> AttentionPlan:
    """The plan of ``segments``; ``dense_below``: positions from which queries attend sparsely
    (DeepSeek-V3.2's ``index_topk``; None: every query attends densely)."""
    device = step.cache.data.device
    limit = float("inf") if dense_below is None else dense_below
    offsets, row = [], 0
    for s in segments:
        offsets.append(row)
        row += s.length
    slots = step.slots
    host = device.type == "cpu"
    decode = [i for i, s in enumerate(segments) if s.length == 1 and s.start < limit]
    decode_mask = None
    lengths = [segments[i].start + 1 for i in decode]
    decode_lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
    if host:
        arrays = [slots[s.seq].numpy() for s in segments]  # views, no copies
        write = [a[s.start : s.start + s.length] for a, s in zip(arrays, segments, strict=True)]
        write = torch.from_numpy(np.concatenate(write) if write else np.zeros(0, np.int64))
    else:
        write = [slots[s.seq][s.start : s.start + s.length] for s in segments]
        write = torch.cat(write) if write else torch.zeros(0, dtype=torch.int64, device=device)
    if decode and host:
        contexts = [arrays[i] for i in decode]
        decode_slots, decode_mask = _host_contexts(contexts, lengths, _decode_length_bucket(step))
    elif decode:
        contexts = [
            slots[segments[i].seq][:length] for i, length in zip(decode, lengths, strict=True)
        ]
        decode_slots = pad_sequence(contexts, batch_first=True)
        bucket = _decode_length_bucket(step)
        if decode_slots.shape[1] % bucket:
            decode_slots = F.pad(decode_slots, (0, bucket - decode_slots.shape[1] % bucket))
        if min(lengths) < decode_slots.shape[1]:
            positions = torch.arange(decode_slots.shape[1], device=device)
            decode_mask = (positions[None, :] < decode_lengths[:, None])[:, None]
    else:
        decode_slots = torch.zeros(0, 0, dtype=torch.int64, device=device)
    chunks, short = [], {}
    for i, s in enumerate(segments):
        dense = min(s.length, max(0, limit - s.start))
        if 1 < s.length <= SHORT_CHUNK and dense == s.length:
            short.setdefault(s.length, []).append(i)
        elif s.length > 1 and dense:
            chunks.append(_causal(slots[s.seq], s.start, int(dense), offsets[i], device))
    return AttentionPlan(
        row,
        write,
        torch.tensor([offsets[i] for i in decode], dtype=torch.int64, device=device),
        decode_slots,
        decode_lengths,
        decode_mask,
        chunks,
        _sparse_parts(segments, offsets, slots, limit, device) if dense_below is not None else [],
        [_batched(segments, idx, n, offsets, slots, device) for n, idx in short.items()],
    )


def _host_contexts(contexts: list[np.ndarray], lengths: list[int], bucket: int):
    """``(decode_slots [D, L], decode_mask [D, 1, L] or None)`` of a CPU cache from each decode
    row's slots, built in numpy: one copy per context where torch's ``pad_sequence`` and mask
    cost a few operators each (the plan of a decode step 21 -> 14 us at one request, 26 -> 16 at
    32; 1 thread)."""
    width = -(-max(lengths) // bucket) * bucket
    table = np.zeros((len(contexts), width), np.int64)
    for row, (context, length) in enumerate(zip(contexts, lengths, strict=True)):
        table[row, :length] = context[:length]
    mask = None
    if min(lengths) < width:
        mask = torch.from_numpy(np.arange(width) < np.array(lengths)[:, None])[:, None]
    return torch.from_numpy(table), mask


# Decode contexts of a bfloat16 (float16) cache on the CPU are padded to a multiple of this many
# tokens: oneDNN, which runs those matmuls, builds a kernel for every new shape (~0.4 ms against
# ~0.05 ms for the matmul of 8 requests over 300 tokens), and a context one token longer every
# step is a new shape every step.
DECODE_LENGTH_BUCKET = 64


def _decode_length_bucket(step: StepCache) -> int:
    data = step.cache.data
    return DECODE_LENGTH_BUCKET if data.device.type == "cpu" and data.dtype != torch.float32 else 1


# Chunks up to this many tokens are attended together, like decode rows: a step verifying draft
# tokens has one such chunk per request (one call per chunk cost 0.28x the decode speed at 32).
SHORT_CHUNK = 16


def _batched(segments, indices: list[int], n: int, offsets, slots, device):
    """``(rows [S * n], context slots [S, L], mask [S, n, L])`` of the ``S`` segments
    ``indices``, each ``n`` tokens long, every query seeing its sequence up to its position."""
    rows = torch.tensor(
        [offsets[i] + j for i in indices for j in range(n)], dtype=torch.int64, device=device
    )
    contexts = [slots[segments[i].seq][: segments[i].start + n] for i in indices]
    context = pad_sequence(contexts, batch_first=True)
    starts = torch.tensor([segments[i].start for i in indices], device=device)
    positions = starts[:, None] + torch.arange(n, device=device)[None, :]
    keys = torch.arange(context.shape[1], device=device)
    return rows, context, keys[None, None, :] <= positions[:, :, None]


def _causal(seq_slots: torch.Tensor, start: int, length: int, row: int, device):
    """``(rows [n], context slots [m], mask [1, n, m])`` of positions ``start .. start+length-1``
    at rows ``row ..``, each seeing every position up to its own."""
    end = start + length
    keys = torch.arange(end, device=device)
    mask = keys[None, :] <= torch.arange(start, end, device=device)[:, None]
    rows = torch.arange(row, row + length, device=device)
    return rows, seq_slots[:end], mask[None]


def _sparse_parts(segments, offsets, slots, limit, device) -> list:
    """Rows at positions ``>= limit``: one part per prompt chunk (its rows share the chunk's
    context), and one for all decode rows (contexts padded to the longest)."""
    parts, decode = [], []
    for i, s in enumerate(segments):
        end = s.start + s.length
        if end <= limit:
            continue
        if s.length == 1:
            decode.append(i)
            continue
        first = max(s.start, int(limit))
        row = offsets[i] + first - s.start
        rows, context, mask = _causal(slots[s.seq], first, end - first, row, device)
        parts.append((rows, context, mask[0]))
    if decode:
        contexts = [slots[segments[i].seq][: segments[i].start + 1] for i in decode]
        lengths = torch.tensor([segments[i].start + 1 for i in decode], device=device)
        context = pad_sequence(contexts, batch_first=True)
        mask = torch.arange(context.shape[1], device=device)[None, :] < lengths[:, None]
        rows = torch.tensor([offsets[i] for i in decode], dtype=torch.int64, device=device)
        parts.append((rows, context, mask))
    return parts


def paged_mla_attention(
    mla: MLA,
    latent: Latent,
    segments: list[Segment],
    cache: LayerCache,
    index: IndexQuery | None = None,
    topk: int = 0,
) -> torch.Tensor:
    """Attention output ``[T, H]`` of the ``T`` tokens of ``segments`` (concatenated in order).
    With DeepSeek-V3.2's ``index`` (its keys cached beside the latent), queries at positions
    ``>= topk`` attend to the ``topk`` entries the indexer selects."""
    sparse = index is not None
    build = functools.partial(plan_attention, dense_below=topk) if sparse else plan_attention
    plan = cache.step.plan(tuple(segments), build)
    if plan.num_tokens == 0:
        return latent.q_nope.new_zeros(0, mla.wo.out_features)
    cached = cache.rows()  # [slots, values]: the latent, the rotated key (, the index key)
    written = [latent.kv, latent.k_pe] + ([index.key] if sparse else [])
    cached.index_copy_(0, plan.write, torch.cat(written, dim=-1).to(cached.dtype))
    width = mla.config.kv_lora_rank + mla.config.qk_rope_head_dim
    store = cached[:, :width] if sparse else cached
    if not plan.chunks and not plan.sparse and not plan.short:  # decode only: rows in order
        if cpu_kernels.usable(store, latent.q_nope, latent.q_pe, mla.wkv_b.weight):
            return fused_decode_attention(mla, latent, store, plan)
        query = latent_query(mla, latent, decode_dtype(mla, latent, store, plan.decode_slots))
        return decode_attention(mla, query, store, plan.decode_slots, plan.decode_mask)
    out = latent.q_nope.new_empty(plan.num_tokens, mla.wo.out_features)
    # rows are gathered and placed with index_select / index_copy_: indexing with a tensor
    # (``query[rows]``, ``out[rows] = ...``) runs ~10x as long on the CPU
    if plan.decode_rows.numel():
        rows = plan.decode_rows
        decoding = _rows_of(latent, rows)
        if cpu_kernels.usable(store, latent.q_nope, latent.q_pe, mla.wkv_b.weight):
            part = fused_decode_attention(mla, decoding, store, plan)
        else:
            query = latent_query(mla, decoding)
            part = decode_attention(mla, query, store, plan.decode_slots, plan.decode_mask)
        out.index_copy_(0, rows, part)
    for rows, context, mask in plan.short:
        query = latent_query(mla, _rows_of(latent, rows))
        out.index_copy_(0, rows, decode_attention(mla, query, store, context, mask))
    fresh = _fresh_chunks(mla, latent, store, plan.chunks)
    if fresh:
        _fresh_chunks_attention(mla, latent, fresh, out)
    shared = {id(chunk) for chunk in fresh}
    for rows, context, mask in (c for c in plan.chunks if id(c) not in shared):
        ctx = gather(store, context).to(out.dtype)
        if rows.numel() > expanded_attention_threshold(mla):
            part = expanded_attention(mla, latent, rows, ctx, mask[0])
        else:
            part = latent_attention(
                mla, latent_query(mla, _rows_of(latent, rows)), ctx[None], mask
            )[0]
        out.index_copy_(0, rows, part)
    if plan.sparse:
        keys = cached[:, width:]
        chosen = [(r, select_tokens(index, keys, r, c, m, topk)) for r, c, m in plan.sparse]
        rows = torch.cat([r for r, _ in chosen])
        selected = torch.cat([s for _, s in chosen])
        query = latent_query(mla, _rows_of(latent, rows))
        out.index_copy_(0, rows, decode_attention(mla, query, store, selected, None))
    return out


def _fresh_chunks(mla: MLA, latent: Latent, store: torch.Tensor, chunks: list) -> list:
    """The prompt chunks of a step that share their projections (:func:`_fresh_chunks_attention`):
    those that start their prompt (their context is their own rows, written this step in the
    cache's dtype) and are long enough for the expanded form, on the CPU kernel; none unless at
    least two."""
    if store.dtype != latent.kv.dtype or not cpu_kernels.usable(
        latent.q_nope, latent.q_pe, latent.kv, mla.wkv_b.weight
    ):
        return []
    threshold = expanded_attention_threshold(mla)
    fresh = [c for c in chunks if c[0].numel() == c[1].numel() > threshold]
    return fresh if len(fresh) > 1 else []


def _fresh_chunks_attention(mla: MLA, latent: Latent, chunks: list, out: torch.Tensor) -> None:
    """:func:`expanded_attention` of prompts' first chunks (:func:`_fresh_chunks`) into ``out``,
    their keys and values expanded by one ``wkv_b`` and their outputs projected by one ``wo`` over
    all their rows, read from the step's latents (what the cache holds of them): a step of 16
    128-token prompts of the small benchmark checkpoint ran 2 x 16 small projections, 32
    concatenations and 16 gathers a layer."""
    rows = torch.cat([r for r, _, _ in chunks])
    kv, k_pe = latent.kv.index_select(0, rows), latent.k_pe.index_select(0, rows)
    q, k, v = _expanded_qkv(mla, latent, rows, kv, k_pe)
    parts, start = [], 0
    for chunk_rows, _, _ in chunks:
        span = slice(start, start + chunk_rows.numel())
        parts.append(_prefill_kernel(mla, q[span], k[span], v[span]))
        start = span.stop
    out.index_copy_(0, rows, mla.wo(torch.cat(parts).flatten(1)))


def _expanded_qkv(
    mla: MLA, latent: Latent, rows: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries of ``rows`` ``[n, heads, qk_nope + qk_rope]`` and the per-head keys (the same
    width) and values ``[m, heads, v_head_dim]`` of the latents ``kv [m, kv_lora_rank]`` with
    their rotated keys ``k_pe [m, qk_rope_head_dim]``."""
    c, heads, m = mla.config, mla.heads, kv.shape[0]
    expanded = mla.wkv_b(kv).view(m, heads, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = expanded.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None].expand(m, heads, c.qk_rope_head_dim)], dim=-1)
    q = torch.cat([latent.q_nope.index_select(0, rows), latent.q_pe.index_select(0, rows)], dim=-1)
    return q, k, v


def _prefill_kernel(mla: MLA, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``prefill_attention`` of a causal chunk ``[n, heads, v_head_dim]``, bfloat16 products in
    pairs where the CPU has AVX512-BF16."""
    pairs = cpu_features.detect().avx512_bf16
    return torch.ops.moeinfra.prefill_attention(q, k, v, mla.scale, pairs)


def _rows_of(latent: Latent, rows: torch.Tensor) -> Latent:
    """The queries of ``rows`` (the cached parts are not needed once written): the latent query
    of a step's rows is computed only for those that attend in the absorbed form (a prefill
    chunk past :func:`expanded_attention_threshold` does not)."""
    return Latent(
        latent.q_nope.index_select(0, rows), latent.q_pe.index_select(0, rows), None, None
    )


# Multiply-adds up to which a bfloat16 (float16) decode step's attention runs in float32 on the CPU:
# small batched matmuls in bfloat16 cost ~15-27 us of set-up each against ~4-9 in float32 (the
# four products of one request over 320 tokens of the small benchmark checkpoint, 8 heads of
# latent 64, 0.44M multiply-adds: 109 vs 75 us; 8 requests, 3.5M: 134 vs 116; 8 heads of
# DeepSeek-V3's latent width, one request, 3.8M: 190 vs 143), while larger products are cheaper in
# bfloat16 (8 heads of DeepSeek-V3's width, 2 requests over 320 tokens, 7.7M: 181 vs 216 us;
# DeepSeek-V3's 128 heads, one request over 384 tokens, 70M: ~3.5 vs ~4.2 ms). 2 threads, AMD EPYC.
FLOAT32_DECODE_MACS = 1 << 22
_HALF = (torch.bfloat16, torch.float16)


def decode_dtype(
    mla: MLA, latent: Latent, store: torch.Tensor, slots: torch.Tensor
) -> torch.dtype | None:
    """The dtype a decode step's attention of ``latent``'s queries over ``store[slots]`` computes
    in: float32 for a small one (:data:`FLOAT32_DECODE_MACS`) over a half-precision CPU cache,
    else None (the model's). The choice depends on the whole step (its requests and their padded
    lengths), so a bfloat16 request's greedy tokens may depend on its batch."""
    if store.device.type != "cpu" or store.dtype not in _HALF:
        return None
    return torch.float32 if _small_decode(mla, latent, store, slots) else None


def _small_decode(mla: MLA, latent: Latent, store: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether the four products of a decode step's attention stay within
    :data:`FLOAT32_DECODE_MACS` multiply-adds (heads included)."""
    c, rows = mla.config, latent.q_nope.shape[0]
    per_request = rows // max(slots.shape[0], 1)
    projections = rows * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
    scores_and_values = per_request * slots.numel() * (store.shape[1] + c.kv_lora_rank)
    return mla.heads * (projections + scores_and_values) <= FLOAT32_DECODE_MACS


def fused_decode_attention(
    mla: MLA, latent: Latent, store: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    """:func:`decode_attention` of a step's decode queries (one per request, in order) as one
    fused CPU kernel -> ``[D, H]``: each request's first ``plan.decode_lengths`` cached rows read
    in place from ``store`` (no gathered copy, no mask), the four products in float32 (as
    :func:`decode_dtype` has a small half-precision step compute), ``wo`` in the model's dtype.
    One request over 320 tokens of the small benchmark checkpoint, attention and ``wo``: 41 vs 78
    us in float32, 56 vs 96 in bfloat16 (2 threads); 8 requests ~157 vs ~238 and ~165 vs ~181.
    Every CPU step's decode rows take it, whatever their number and the cache rows' width: a
    decode step's forward of the small checkpoint (96-wide rows), 32 requests over ~190 tokens,
    11.7 -> 9.4 ms in float32 and 9.2 -> 7.9 in bfloat16; 128 requests 21.3 -> 16.8 (float32);
    16 requests over ~1,100 tokens 18.7 -> 12.3 (float32) and 15.8 -> 9.0 (bfloat16) against the
    torch path (2 threads, AVX-512)."""
    w_uk, w_uv_t = mla.absorbed_weights(torch.float32)
    out = torch.ops.moeinfra.mla_decode(
        latent.q_nope,
        latent.q_pe,
        w_uk,
        w_uv_t,
        store,
        plan.decode_slots,
        plan.decode_lengths,
        mla.scale,
        mla.kv_norm.weight.dtype,
    )
    return mla.wo(out.flatten(1))


# Bytes of cache rows one decode group gathers at most: a group's context stays in the CPU's last
# level cache between its gather and its two matmuls (a batch of 128 requests of 300 tokens gathers
# 88 MB of DeepSeek-V3-wide float32 latents per layer at once otherwise).
DECODE_GATHER_BYTES = 4 << 20


def decode_attention(
    mla: MLA,
    query: torch.Tensor,
    store: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Absorbed attention of ``S * Q`` queries ``query [S * Q, heads, width]`` (``Q`` consecutive
    ones per request: 1 when decoding) over their requests' contexts ``store[slots [S, L]]``, where
    ``mask [S, Q, L]`` (None: everywhere) -> ``[S * Q, H]``; in groups of requests whose gathered
    context fits :data:`DECODE_GATHER_BYTES` (on a GPU, one group)."""
    rows, length = slots.shape
    per_request = query.shape[0] // max(rows, 1)
    per_row = max(length * store.shape[1] * query.element_size(), 1)
    group = rows if store.device.type != "cpu" else max(1, DECODE_GATHER_BYTES // per_row)
    if group >= rows:
        ctx = gather(store, slots).to(query.dtype)
        return latent_attention(mla, query, ctx, mask).flatten(0, 1)
    out = query.new_empty(query.shape[0], mla.wo.out_features)
    for start in range(0, rows, group):
        part = slice(start, start + group)
        queries = slice(start * per_request, (start + group) * per_request)
        ctx = gather(store, slots[part]).to(query.dtype)
        sub_mask = None if mask is None else mask[part]
        out[queries] = latent_attention(mla, query[queries], ctx, sub_mask).flatten(0, 1)
    return out


def expanded_attention_threshold(mla: MLA) -> float:
    """Queries of a chunk above which attending with per-head keys and values (``wkv_b`` applied
    to the chunk's context, vLLM's and SGLang's prefill path) costs fewer multiply-adds than the
    absorbed form: expanding costs ``kv_lora_rank * heads * (qk_nope + v)`` per key once, and
    saves ``heads * (2 kv_lora_rank - qk_nope - v)`` per query-key pair (64 queries for the tiny
    model's widths, 171 for DeepSeek-V3's)."""
    c = mla.config
    saved = 2 * c.kv_lora_rank - c.qk_nope_head_dim - c.v_head_dim
    if saved <= 0:
        return float("inf")
    return c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim) / saved


def expanded_attention(
    mla: MLA, latent: Latent, rows: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention output ``[n, H]`` of the queries ``rows [n]`` over the cache entries
    ``ctx [m, kv_lora_rank + qk_rope_head_dim]``, with keys and values expanded per head by
    ``wkv_b`` and ``mask [n, m]`` True where a query may attend: a prompt chunk's causal mask
    (query ``i`` sees keys up to ``m - n + i``, as :func:`plan_attention` builds it). The same
    function as the absorbed form, summed in another order. On the CPU the fused
    ``prefill_attention`` kernel computes that mask instead of reading it and never writes the
    ``n x m`` scores (a 2,000-token prompt of the small benchmark checkpoint, 8 heads: ~59 vs
    ~259 ms a layer)."""
    rank = mla.config.kv_lora_rank
    q, k, v = _expanded_qkv(mla, latent, rows, ctx[:, :rank], ctx[:, rank:])
    if cpu_kernels.usable(q, k, v):
        return mla.wo(_prefill_kernel(mla, q, k, v).flatten(1))
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).mul_(mla.scale)
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
    out = torch.matmul(probs, v.transpose(0, 1))
    return mla.wo(out.transpose(0, 1).flatten(1))
