"""Multi-head latent attention (MLA) of DeepSeek-V3, in the plain ("naive") and the absorbed form.

Queries and keys/values go through low-rank compressions (``q_lora_rank``, ``kv_lora_rank``); each head's
query/key is split into a no-position part and a decoupled RoPE part (``qk_rope_head_dim``), the RoPE key
being shared by all heads. Split in two for the decode pipeline: :meth:`MLA.project` (ATTN-0: down/up
projections and RoPE) and :meth:`MLA.attend` (ATTN-1: core attention and output projection).

The absorbed form (:meth:`MLA.project_latent`, :func:`latent_attention`) is what an inference engine
caches and attends over: per token only the normalised latent ``c_kv [kv_lora_rank]`` and the rotated
shared key ``k_pe [qk_rope_head_dim]``; ``wkv_b``'s key half is folded into the query and its value
half applied after attention, as in DeepSeek's inference code (``attn_impl="absorb"``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from moeinfra.moe.config import MoEConfig
from moeinfra.moe.layers import Linear, RMSNorm, fused_linears, weight_key
from moeinfra.moe.rope import (
    RotaryTable,
    cos_sin_scale,
    inverse_frequencies,
    rotate_cis,
    softmax_scale,
)

# DeepSeek's inference code and transformers give the two latent norms the default epsilon,
# whatever the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Segment:
    """Consecutive tokens of one sequence: positions ``start .. start+length-1`` of ``seq``."""

    seq: int
    start: int
    length: int


@dataclass
class Projected:
    """Output of ATTN-0 for ``T`` tokens: ``q [T, heads, qk_head_dim]``, ``k`` same, ``v [T, heads, v_dim]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class KVCache:
    """Keys/values of earlier positions per sequence, for a sequence split between micro-batches."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)


def positions_of(segments: list[Segment], device: torch.device | None = None) -> torch.Tensor:
    """``[T]`` int64 position of every token of ``segments`` (concatenated in order).

    The same segments give the same tensor object (the last few are kept), so that a step's layers
    share it, and with it the rotary rows gathered for it (:class:`RotaryTable`). Do not modify it.
    """
    return _positions(tuple(segments), None if device is None else torch.device(device))


@functools.lru_cache(maxsize=8)
def _positions(segments: tuple[Segment, ...], device: torch.device | None) -> torch.Tensor:
    # on the host in numpy, one copy to the device: 3-9 us against 16-22 in torch operators
    starts = np.fromiter((s.start for s in segments), np.int64, len(segments))
    lengths = np.fromiter((s.length for s in segments), np.int64, len(segments))
    if (lengths == 1).all():  # a decode step
        positions = starts
    else:
        first_row = np.cumsum(lengths) - lengths
        positions = np.arange(lengths.sum()) + np.repeat(starts - first_row, lengths)
    positions = torch.from_numpy(positions)
    return positions if device is None else positions.to(device)


@dataclass
class Latent:
    """ATTN-0 of the absorbed form for ``T`` tokens: ``q_nope [T, heads, qk_nope_head_dim]``,
    ``q_pe [T, heads, qk_rope_head_dim]`` (rotated), ``kv [T, kv_lora_rank]`` (normalised latent) and
    ``k_pe [T, qk_rope_head_dim]`` (rotated) — the last two are what a KV cache stores."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv: torch.Tensor
    k_pe: torch.Tensor


class MLA(nn.Module):
    """MLA attention, ``[T, H] -> [T, H]`` over causal sequences."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        c = self.config = config
        self.heads = c.num_attention_heads
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank)
        self.q_norm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
        self.wq_b = Linear(c.q_lora_rank, self.heads * c.qk_head_dim)
        self.wkv_a = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_norm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = Linear(c.kv_lora_rank, self.heads * (c.qk_nope_head_dim + c.v_head_dim))
        self.wo = Linear(self.heads * c.v_head_dim, c.hidden_size)
        self.scale = softmax_scale(c.qk_head_dim, c.rope_scaling)
        self.rotary = _rotary_table(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
        # dtype -> (wkv_b's weight_key, w_uk, w_uv_t): see absorbed_weights
        self._absorbed: dict[torch.dtype, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the RoPE dims ``x [T, ..., qk_rope_head_dim]`` to ``positions [T]``."""
        return rotate_cis(x, self.rotary.cis(positions), self.config.rope_interleave)

    def q_latent(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, q_lora_rank]``: the normalised low-rank query of ``x [T, H]`` (normed)."""
        return self.q_norm(self.wq_a(x))

    def project_latent(
        self, x: torch.Tensor, positions: torch.Tensor, q_latent: torch.Tensor | None = None
    ) -> Latent:
        """ATTN-0 of the absorbed form: ``x [T, H]`` (normed), ``positions [T]`` -> :class:`Latent`;
        ``q_latent``: :meth:`q_latent` of ``x`` when the caller already has it."""
        c, n = self.config, x.shape[0]
        if q_latent is None:
            q_a, kv_a = fused_linears(x, self.wq_a, self.wkv_a)
            q_latent = self.q_norm(q_a)
        else:
            kv_a = self.wkv_a(x)
        q = self.wq_b(q_latent).view(n, self.heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv, k_pe = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        # the shared key rides along as one more head: one rotation for both
        pe = self.rope(torch.cat([q_pe, k_pe[:, None]], dim=1), positions)
        return Latent(q_nope, pe[:, : self.heads], self.kv_norm(kv), pe[:, self.heads])

    def absorbed_weights(
        self, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``wkv_b`` split per head, each half as the right operand of a matmul: the key half
        ``[heads, qk_nope_head_dim, kv_lora_rank]`` and the value half transposed
        ``[heads, kv_lora_rank, v_head_dim]``, in ``dtype`` (default: the weight's). At inference
        on the CPU they are kept as contiguous copies per dtype (rebuilt when ``wkv_b`` changes):
        torch's CPU matmul copies a strided operand on every call (1 MB and 0.23 ms per layer and
        step for 8 heads of DeepSeek-V3's latent width)."""
        w = self.wkv_b.weight
        dtype = dtype or w.dtype
        if w.device.type == "cpu" and not torch.is_grad_enabled():
            key = weight_key(w)
            kept = self._absorbed.get(dtype)
            if kept is None or kept[0] != key:
                # copies of an older weight, whatever their dtype, are dropped with it
                self._absorbed = {d: k for d, k in self._absorbed.items() if k[0] == key}
                w_uk, w_uv_t = self._split_absorbed(w.detach().to(dtype))
                kept = self._absorbed[dtype] = (key, w_uk.contiguous(), w_uv_t.contiguous())
            return kept[1], kept[2]
        return self._split_absorbed(w.to(dtype))

    def __getstate__(self):
        return {**super().__getstate__(), "_absorbed": {}}  # a copy builds its own

    def _apply(self, fn, recurse=True):
        self._absorbed = {}  # moved or cast: the copies would be stale, and held in vain
        return super()._apply(fn, recurse)

    def _split_absorbed(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        w = w.view(self.heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :].transpose(1, 2)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> Projected:
        """ATTN-0: ``x [T, H]`` (normed), ``positions [T]`` -> queries, keys, values."""
        c, n = self.config, x.shape[0]
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(n, self.heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, self.rope(q_pe, positions)], dim=-1)
        kv, k_pe = self.wkv_a(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = self.rope(k_pe.unsqueeze(1), positions)
        kv = self.wkv_b(self.kv_norm(kv)).view(n, self.heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.heads, -1)], dim=-1)
        return Projected(q, k, v)

    def attend(
        self, p: Projected, segments: list[Segment], cache: KVCache | None = None
    ) -> torch.Tensor:
        """ATTN-1: causal attention per segment and the output projection; ``[T, H]``.

        A segment that does not start at position 0 reads the earlier positions from ``cache``; every
        segment's keys/values are stored into ``cache`` (when given) for later parts of its sequence.
        """
        outs, row = [], 0
        for s in segments:
            q = p.q[row : row + s.length]
            k, v = p.k[row : row + s.length], p.v[row : row + s.length]
            if s.start:
                k = torch.cat([cache.keys[s.seq][: s.start], k])
                v = torch.cat([cache.values[s.seq][: s.start], v])
            if cache is not None:
                cache.keys[s.seq], cache.values[s.seq] = k, v
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            q_pos = torch.arange(s.start, s.start + s.length, device=q.device)[:, None]
            k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).flatten(1))
            row += s.length
        if not outs:
            return p.q.new_zeros(0, self.wo.out_features)
        return self.wo(torch.cat(outs))

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        return self.attend(self.project(x, positions_of(segments, x.device)), segments, KVCache())


def latent_query(mla: MLA, latent: Latent, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[T, heads, kv_lora_rank + qk_rope_head_dim]``: each head's query in the cache's space —
    ``q_nope W_uk`` (``wkv_b``'s key half folded in) beside the rotated ``q_pe`` — in ``dtype``
    (default: the latent's)."""
    dtype = dtype or latent.q_nope.dtype
    w_uk, _ = mla.absorbed_weights(dtype)
    q_lat = torch.matmul(latent.q_nope.to(dtype).transpose(0, 1), w_uk).transpose(0, 1)
    return torch.cat([q_lat, latent.q_pe.to(dtype)], dim=-1)


def latent_attention(
    mla: MLA, query: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Absorbed MLA attention of ``S`` query groups over their cached contexts -> ``[S, Q, H]``.

    ``query [S * Q, heads, kv_lora_rank + qk_rope_head_dim]`` (:func:`latent_query`, group-major);
    ``ctx [S, L, kv_lora_rank + qk_rope_head_dim]``: each group's cached entries (the normalised
    latent ``c_kv`` then the rotated ``k_pe``; its own tokens included); ``mask [S, Q, L]`` is True
    where a query may attend (None: everywhere). Scores are ``q_nope W_uk c_kv + q_pe k_pe`` times
    the softmax scale; the output is ``wo(softmax @ c_kv W_uv)``. The products run in the
    query's dtype, ``wo`` in the model's (its norms' weights': never kept in FP8).
    """
    groups, length = ctx.shape[:2]
    heads, rank = query.shape[1], mla.config.kv_lora_rank
    q = query.unflatten(0, (groups, -1))
    per_group = q.shape[1]
    scores = torch.matmul(q.flatten(1, 2), ctx.transpose(1, 2)).mul_(mla.scale)
    scores = scores.view(groups, per_group, heads, length)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1).view(groups, per_group * heads, length)
    out_lat = torch.matmul(probs, ctx[..., :rank]).view(groups * per_group, heads, rank)
    _, w_uv_t = mla.absorbed_weights(query.dtype)
    out = torch.matmul(out_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
    return mla.wo(out.flatten(1).to(mla.kv_norm.weight.dtype)).view(groups, per_group, -1)


@functools.cache
def _rotary_table(dim: int, theta: float, yarn) -> RotaryTable:
    """One table per RoPE configuration, shared by every layer (they rotate alike)."""
    return RotaryTable(inverse_frequencies(dim, theta, yarn), cos_sin_scale(yarn))
