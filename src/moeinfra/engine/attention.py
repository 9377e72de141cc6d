"""MLA attention over the paged latent cache (DeepSeek-V3's KV layout).

A step's tokens arrive as segments (a run of consecutive positions of one sequence). Their latents are
written to the sequence's cache slots first, then each query attends to every cached position up to its
own: decode segments (one token each) are batched into one padded gather in the absorbed form; longer
segments (prefill chunks) are attended one by one, a long one with per-head keys and values expanded
from its context (:func:`expanded_attention`, cheaper than the absorbed form past
:func:`expanded_attention_threshold` queries). Which slots to write and gather depends only on the segments, so it
is worked out once per step and micro-batch (:class:`AttentionPlan`) and shared by every layer. The
math is :func:`moeinfra.moe.mla.latent_attention` (absorbed form).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from moeinfra.engine.kv_cache import KVLayout, LayerCache, StepCache
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.mla import MLA, Latent, Segment, latent_attention, latent_query

LATENT, ROPE_KEY = "kv", "k_pe"


def mla_layout(block: MoEConfig, num_layers: int, dtype: torch.dtype) -> KVLayout:
    """Per token per layer: the normalised latent and the rotated shared key."""
    return KVLayout(
        ((LATENT, block.kv_lora_rank), (ROPE_KEY, block.qk_rope_head_dim)), num_layers, dtype
    )


@dataclass
class AttentionPlan:
    """Slots of one micro-batch's tokens: ``write [T]``; decode rows ``decode_rows [D]`` gathering
    ``decode_slots [D, L]`` where ``decode_mask [D, 1, L]`` (None when every context is ``L`` long);
    per prefill chunk ``(rows [n], context slots [m], mask [1, n, m])``. On the cache's device."""

    num_tokens: int
    write: torch.Tensor
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    decode_mask: torch.Tensor | None
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def plan_attention(step: StepCache, segments: list[Segment]) -> AttentionPlan:
    device = step.cache.data.device
    offsets, row = [], 0
    for s in segments:
        offsets.append(row)
        row += s.length
    slots = step.slots
    write = [slots[s.seq][s.start : s.start + s.length] for s in segments]
    decode = [i for i, s in enumerate(segments) if s.length == 1]
    decode_mask = None
    if decode:
        contexts = [slots[segments[i].seq][: segments[i].start + 1] for i in decode]
        decode_slots = pad_sequence(contexts, batch_first=True)
        lengths = [segments[i].start + 1 for i in decode]
        if min(lengths) < max(lengths):
            lengths = torch.tensor(lengths, device=device)
            positions = torch.arange(decode_slots.shape[1], device=device)
            decode_mask = (positions[None, :] < lengths[:, None])[:, None]
    else:
        decode_slots = torch.zeros(0, 0, dtype=torch.int64, device=device)
    chunks = []
    for i, s in enumerate(segments):
        if s.length > 1:
            end = s.start + s.length
            keys = torch.arange(end, device=device)
            mask = keys[None, :] <= torch.arange(s.start, end, device=device)[:, None]
            rows = torch.arange(offsets[i], offsets[i] + s.length, device=device)
            chunks.append((rows, slots[s.seq][:end], mask[None]))
    return AttentionPlan(
        row,
        torch.cat(write) if write else torch.zeros(0, dtype=torch.int64, device=device),
        torch.tensor([offsets[i] for i in decode], dtype=torch.int64, device=device),
        decode_slots,
        decode_mask,
        chunks,
    )


def paged_mla_attention(
    mla: MLA, latent: Latent, segments: list[Segment], cache: LayerCache
) -> torch.Tensor:
    """Attention output ``[T, H]`` of the ``T`` tokens of ``segments`` (concatenated in order)."""
    plan = cache.step.plan(tuple(segments), plan_attention)
    if plan.num_tokens == 0:
        return latent.q_nope.new_zeros(0, mla.wo.out_features)
    store = cache.rows()  # [slots, kv_lora_rank + qk_rope_head_dim]: the latent, then the key
    store[plan.write] = torch.cat([latent.kv, latent.k_pe], dim=-1).to(store.dtype)
    query = latent_query(mla, latent)
    if not plan.chunks:  # decode only: every row in order
        return decode_attention(mla, query, store, plan.decode_slots, plan.decode_mask)
    out = query.new_empty(plan.num_tokens, mla.wo.out_features)
    if plan.decode_rows.numel():
        rows = plan.decode_rows
        out[rows] = decode_attention(mla, query[rows], store, plan.decode_slots, plan.decode_mask)
    for rows, context, mask in plan.chunks:
        ctx = store[context].to(query.dtype)
        if rows.numel() > expanded_attention_threshold(mla):
            out[rows] = expanded_attention(mla, latent, rows, ctx, mask[0])
        else:
            out[rows] = latent_attention(mla, query[rows], ctx[None], mask)[0]
    return out


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
    """Absorbed attention of ``D`` decode queries ``query [D, heads, width]`` over their contexts
    ``store[slots [D, L]]`` -> ``[D, H]``, in groups of requests whose gathered context fits
    :data:`DECODE_GATHER_BYTES` (on a GPU, one group)."""
    rows, length = slots.shape
    per_row = max(length * store.shape[1] * query.element_size(), 1)
    group = rows if store.device.type != "cpu" else max(1, DECODE_GATHER_BYTES // per_row)
    if group >= rows:
        ctx = store[slots].to(query.dtype)
        return latent_attention(mla, query, ctx, mask)[:, 0]
    out = query.new_empty(rows, mla.wo.out_features)
    for start in range(0, rows, group):
        part = slice(start, start + group)
        ctx = store[slots[part]].to(query.dtype)
        sub_mask = None if mask is None else mask[part]
        out[part] = latent_attention(mla, query[part], ctx, sub_mask)[:, 0]
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
    ``wkv_b`` and ``mask [n, m]`` True where a query may attend. The same function as the
    absorbed form, summed in another order."""
    c, heads, m = mla.config, mla.heads, ctx.shape[0]
    rank = c.kv_lora_rank
    kv = mla.wkv_b(ctx[:, :rank]).view(m, heads, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k = torch.cat([k_nope, ctx[:, None, rank:].expand(m, heads, c.qk_rope_head_dim)], dim=-1)
    q = torch.cat([latent.q_nope[rows], latent.q_pe[rows]], dim=-1)
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).mul_(mla.scale)
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
    out = torch.matmul(probs, v.transpose(0, 1))
    return mla.wo(out.transpose(0, 1).flatten(1))
