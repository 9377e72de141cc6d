"""MLA attention over the paged latent cache (DeepSeek-V3's KV layout).

A step's tokens arrive as segments (a run of consecutive positions of one sequence). Their latents are
written to the sequence's cache slots first, then each query attends to every cached position up to its
own: decode segments (one token each) are batched into one padded gather, longer segments (prefill
chunks) are attended one by one. The math is :func:`moeinfra.moe.mla.latent_attention` (absorbed form).
"""

from __future__ import annotations

import torch

from moeinfra.engine.kv_cache import KVLayout, LayerCache
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.mla import MLA, Latent, Segment, latent_attention

LATENT, ROPE_KEY = "kv", "k_pe"


def mla_layout(block: MoEConfig, num_layers: int, dtype: torch.dtype) -> KVLayout:
    """Per token per layer: the normalised latent and the rotated shared key."""
    return KVLayout(
        ((LATENT, block.kv_lora_rank), (ROPE_KEY, block.qk_rope_head_dim)), num_layers, dtype
    )


def _rows(latent: Latent, rows: torch.Tensor) -> Latent:
    return Latent(latent.q_nope[rows], latent.q_pe[rows], latent.kv[rows], latent.k_pe[rows])


def paged_mla_attention(
    mla: MLA, latent: Latent, segments: list[Segment], cache: LayerCache
) -> torch.Tensor:
    """Attention output ``[T, H]`` of the ``T`` tokens of ``segments`` (concatenated in order)."""
    kv_store, pe_store = cache.part(LATENT), cache.part(ROPE_KEY)
    offsets, row = [], 0
    for s in segments:
        offsets.append(row)
        row += s.length
    if row == 0:
        return latent.q_nope.new_zeros(0, mla.wo.out_features)
    write = torch.cat([cache.positions(s.seq, s.start, s.start + s.length) for s in segments])
    kv_store[write] = latent.kv.to(kv_store.dtype)
    pe_store[write] = latent.k_pe.to(pe_store.dtype)
    out = latent.q_nope.new_empty(row, mla.wo.out_features)
    decode = [i for i, s in enumerate(segments) if s.length == 1]
    if decode:
        lengths = torch.tensor([segments[i].start + 1 for i in decode])
        longest = int(lengths.max())
        gather = torch.zeros(len(decode), longest, dtype=torch.int64)
        for j, i in enumerate(decode):
            s = segments[i]
            gather[j, : s.start + 1] = cache.positions(s.seq, 0, s.start + 1)
        mask = (torch.arange(longest)[None, :] < lengths[:, None])[:, None, :]
        rows = torch.tensor([offsets[i] for i in decode])
        kv = kv_store[gather].to(latent.kv.dtype)
        pe = pe_store[gather].to(latent.kv.dtype)
        out[rows] = latent_attention(mla, _rows(latent, rows), kv, pe, mask)[:, 0]
    for i, s in enumerate(segments):
        if s.length == 1:
            continue
        end = s.start + s.length
        ctx = cache.positions(s.seq, 0, end)
        rows = torch.arange(offsets[i], offsets[i] + s.length)
        q_pos = torch.arange(s.start, end)[:, None]
        mask = (torch.arange(end)[None, :] <= q_pos)[None]
        kv = kv_store[ctx].to(latent.kv.dtype)[None]
        pe = pe_store[ctx].to(latent.kv.dtype)[None]
        out[rows] = latent_attention(mla, _rows(latent, rows), kv, pe, mask)[0]
    return out
