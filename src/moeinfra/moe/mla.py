"""Multi-head latent attention (MLA) of DeepSeek-V3, in the plain ("naive") form.

Queries and keys/values go through low-rank compressions (``q_lora_rank``, ``kv_lora_rank``); each head's
query/key is split into a no-position part and a decoupled RoPE part (``qk_rope_head_dim``), the RoPE key
being shared by all heads. Split in two for the decode pipeline: :meth:`MLA.project` (ATTN-0: down/up
projections and RoPE) and :meth:`MLA.attend` (ATTN-1: core attention and output projection).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moeinfra.moe.config import MoEConfig
from moeinfra.moe.layers import RMSNorm


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
    """``[T]`` int64 position of every token of ``segments`` (concatenated in order)."""
    if not segments:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(s.start, s.start + s.length, device=device) for s in segments])


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of the last dim of ``x [T, ..., d]`` by ``positions [T]`` (interleaved pairs)."""
    d = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    pairs = x.float().unflatten(-1, (d // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


class MLA(nn.Module):
    """MLA attention, ``[T, H] -> [T, H]`` over causal sequences."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        c = self.config = config
        self.heads = c.num_attention_heads
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, self.heads * c.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.wkv_b = nn.Linear(
            c.kv_lora_rank, self.heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.wo = nn.Linear(self.heads * c.v_head_dim, c.hidden_size, bias=False)
        self.scale = c.qk_head_dim**-0.5

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> Projected:
        """ATTN-0: ``x [T, H]`` (normed), ``positions [T]`` -> queries, keys, values."""
        c, n = self.config, x.shape[0]
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(n, self.heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, rope(q_pe, positions, c.rope_theta)], dim=-1)
        kv, k_pe = self.wkv_a(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = rope(k_pe.unsqueeze(1), positions, c.rope_theta)
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
