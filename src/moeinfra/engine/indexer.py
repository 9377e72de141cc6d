"""DeepSeek-V3.2's lightning indexer: which earlier tokens each query's MLA attends to (DeepSeek
Sparse Attention, DSA).

Per token the indexer caches one key ``k = LayerNorm(wk(x))`` of ``head_dim`` (its first
``qk_rope_head_dim`` dims rotated, pairs ``(i, i + d/2)`` — *not* MLA's interleaved pairs). A query
has ``heads`` index heads ``q_h = wq_b(q_latent)`` (rotated alike) and per-head weights
``w = weights_proj(x) / sqrt(heads)``; a key's score is ``sum_h w_h ReLU(q_h . k) / sqrt(head_dim)``
in float32, and the query attends to its ``topk`` best-scored earlier tokens (itself included).
Formulas as in DeepSeek's inference code and ``transformers``' ``DeepseekV32Indexer`` (which skips the
Hadamard rotation and FP8 scoring of DeepSeek's kernels: both leave the dot products as they are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeinfra.engine.hf_config import IndexerConfig
from moeinfra.engine.kv_cache import gather
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.layers import Linear
from moeinfra.moe.rope import rotate

# transformers' and DeepSeek's k_norm: LayerNorm with a bias and the default epsilon.
KEY_NORM_EPS = 1e-6
# Score elements (queries x heads x keys, float32) one scoring pass holds at most.
SCORE_ELEMENTS = 1 << 24


@dataclass
class IndexQuery:
    """The indexer's projections of ``T`` tokens: queries ``q [T, heads, head_dim]``, the key each
    token caches ``key [T, head_dim]``, and float32 head weights ``weights [T, heads]`` (the
    ``1/sqrt(heads * head_dim)`` scales folded in)."""

    q: torch.Tensor
    key: torch.Tensor
    weights: torch.Tensor


class Indexer(nn.Module):
    """One layer's indexer: ``wq_b``, ``wk``, ``k_norm`` (LayerNorm with bias), ``weights_proj``
    (kept in float32, as DeepSeek and transformers keep it)."""

    def __init__(self, block: MoEConfig, config: IndexerConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_dim = block.qk_rope_head_dim
        self.wq_b = Linear(block.q_lora_rank, config.heads * config.head_dim)
        self.wk = Linear(block.hidden_size, config.head_dim)
        self.k_norm = nn.LayerNorm(config.head_dim, eps=KEY_NORM_EPS)
        self.weights_proj = Linear(block.hidden_size, config.heads)

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, cis: torch.Tensor) -> IndexQuery:
        """``x [T, H]`` (the attention's normed input), ``q_latent [T, q_lora_rank]`` (MLA's
        normalised low-rank query) and the tokens' rotary rows ``cis [T, rope/2]``."""
        c, n = self.config, x.shape[0]
        q = self.wq_b(q_latent).view(n, c.heads, c.head_dim)
        k = self.k_norm(self.wk(x))
        # the key rides along as one more head: one rotation for both
        qk = torch.cat([q, k[:, None]], dim=1)
        rot = rotate(qk[..., : self.rope_dim], cis.real, cis.imag, interleaved=False)
        qk = torch.cat([rot, qk[..., self.rope_dim :]], dim=-1)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        weights = weights * (c.heads * c.head_dim) ** -0.5
        return IndexQuery(qk[:, : c.heads], qk[:, c.heads], weights)


def index_scores(index: IndexQuery, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` float32 scores of the queries ``rows [n]`` over ``keys [m, head_dim]`` (shared by
    the rows) or ``[n, m, head_dim]`` (one context per row)."""
    q = index.q[rows].float()
    k = keys.float()
    k = k.transpose(-1, -2) if k.dim() == 3 else k.t()[None]
    per_head = torch.matmul(q, k).relu_()  # [n, heads, m]
    return torch.matmul(index.weights[rows, None, :], per_head)[:, 0]


def select_tokens(
    index: IndexQuery,
    keys: torch.Tensor,
    rows: torch.Tensor,
    context: torch.Tensor,
    mask: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """``[n, topk]`` cache slots of the ``topk`` best-scored keys of each query ``rows [n]``.

    ``keys [slots, head_dim]``: the layer's cached index keys; ``context``: the slots a query may
    see, ``[m]`` shared by the rows (a prompt chunk) or ``[n, m]`` (one decode request per row);
    ``mask [n, m]`` True where a query may attend — at least ``topk`` per row."""
    heads = index.q.shape[1]
    per_row = heads * context.shape[-1]
    group = max(1, SCORE_ELEMENTS // max(per_row, 1))
    out = []
    for start in range(0, rows.numel(), group):
        part = slice(start, start + group)
        ctx = context if context.dim() == 1 else context[part]
        scores = index_scores(index, rows[part], gather(keys, ctx))
        scores.masked_fill_(~mask[part], float("-inf"))
        best = scores.topk(topk, dim=-1, sorted=False).indices  # attention sums in any order
        out.append(ctx[best] if ctx.dim() == 1 else ctx.gather(1, best))
    return torch.cat(out)
