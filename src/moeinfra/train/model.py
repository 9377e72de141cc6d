"""A trainable DeepSeek-V3 with its multi-token-prediction (MTP) layer, cut into pipeline stages.

The layers are :mod:`moeinfra.moe`'s (MLA, the gate with its selection bias, SwiGLU experts) — the
ones the engine serves — with autograd. One sequence batch ``ids [B, T]`` gives the main model's
logits for the next tokens and the MTP layer's for the tokens after them (DeepSeek-V3's depth-1 MTP:
``g_i = block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))`` with ``h_i`` the main model's final
hidden state after its norm, the embedding zeroed at position 0 — as the engine drafts with it). The
embedding and output head are shared by the main model and the MTP layer, as in DeepSeek-V3's
training; the checkpoint stores the MTP's copies under its own names.

:func:`stages` cuts the model into ``2P`` pipeline stages for DualPipeV on ``P`` ranks: the first holds
the embedding, the last the final norm, head and MTP layer (both on rank 0 in DualPipeV's V, so the
shared embedding is one tensor); stage tensors are ``(hidden [b, T, H], next_ids [b, T])``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moeinfra.engine.hf_config import ModelConfig
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.layers import Expert as SwiGLU
from moeinfra.moe.layers import MoE, RMSNorm
from moeinfra.moe.mla import MLA, Segment


class Block(nn.Module):
    """One decoder layer: ``x + MLA(norm(x))``, then a dense SwiGLU (``dense_intermediate``) or
    the MoE, on ``[B, T, H]`` sequences that each start at position 0."""

    def __init__(self, config: MoEConfig, dense_intermediate: int | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = MLA(config)
        self.moe_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if dense_intermediate is None:
            self.moe = MoE(config)
            # routed copies per expert since the last bias update (auxiliary-loss-free balancing)
            self.register_buffer("load", torch.zeros(config.num_routed_experts), persistent=False)
        else:
            self.mlp = SwiGLU(config.hidden_size, dense_intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, hidden = x.shape
        flat = x.reshape(b * t, hidden)
        segments = [Segment(i, 0, t) for i in range(b)]
        h = flat + self.attn(self.attn_norm(flat), segments)
        hn = self.moe_norm(h)
        if not hasattr(self, "moe"):
            return (h + self.mlp(hn)).view(b, t, hidden)
        weights, indices = self.moe.gate(hn)
        self.load += torch.bincount(indices.flatten(), minlength=self.load.numel()).to(self.load)
        out = h + self.moe.routed(hn, weights, indices) + self.moe.shared_output(hn)
        return out.view(b, t, hidden)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: raise the selection bias of experts that
        got fewer routed tokens than the mean since the last update, lower the others', by
        ``rate``; then start counting again."""
        if hasattr(self, "moe") and self.load.sum() > 0:
            self.moe.gate.bias += rate * torch.sign(self.load.mean() - self.load)
            self.load.zero_()


class MTPLayer(nn.Module):
    """The MTP layer's own parts: the two input norms, ``eh_proj``, its decoder layer and the norm
    before the (shared) head."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = Block(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embedded: torch.Tensor) -> torch.Tensor:
        """``hidden [B, T, H]`` (the main model's, normed) and ``next_embedded [B, T, H]`` (the
        embedding of each position's next token) -> the normed MTP output ``[B, T, H]``."""
        next_embedded = next_embedded.clone()
        next_embedded[:, 0] = 0.0
        x = self.eh_proj(torch.cat([self.enorm(next_embedded), self.hnorm(hidden)], dim=-1))
        return self.norm(self.block(x))


class FirstStage(nn.Module):
    """The embedding and the first layers: ``(ids, next_ids) -> (hidden, next_ids)``."""

    def __init__(self, embed: nn.Embedding, blocks: list[Block]) -> None:
        super().__init__()
        self.embed, self.blocks = embed, nn.ModuleList(blocks)

    def forward(self, ids: torch.Tensor, next_ids: torch.Tensor):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x, next_ids


class MiddleStage(nn.Module):
    """Layers in the middle: ``(hidden, next_ids) -> (hidden, next_ids)``."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, next_ids: torch.Tensor):
        for block in self.blocks:
            x = block(x)
        return x, next_ids


class LastStage(nn.Module):
    """The last layers, the final norm and head, and the MTP layer:
    ``(hidden, next_ids) -> (logits [B, T, V], mtp_logits [B, T, V])``."""

    def __init__(
        self,
        blocks: list[Block],
        norm: RMSNorm,
        head: nn.Linear,
        embed: nn.Embedding,
        mtp: MTPLayer,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.head, self.embed, self.mtp = norm, head, embed, mtp

    def forward(self, x: torch.Tensor, next_ids: torch.Tensor):
        for block in self.blocks:
            x = block(x)
        h = self.norm(x)
        return self.head(h), self.head(self.mtp(h, self.embed(next_ids)))


class DeepSeekForTraining(nn.Module):
    """The whole model of ``config`` (its ``first_k_dense_replace`` dense layers, MoE layers and one
    MTP layer), weights drawn from ``seed``."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        block = config.block
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Embedding(config.vocab_size, block.hidden_size)
            nn.init.normal_(self.embed.weight, std=1.0)
            self.blocks = nn.ModuleList(
                Block(block, config.intermediate_size if i < config.first_k_dense_replace else None)
                for i in range(config.num_layers)
            )
            self.norm = RMSNorm(block.hidden_size, block.rms_norm_eps)
            self.head = nn.Linear(block.hidden_size, config.vocab_size, bias=False)
            self.mtp = MTPLayer(block)
        self.config = config

    def forward(self, ids: torch.Tensor, next_ids: torch.Tensor):
        """``ids, next_ids [B, T]`` -> ``(logits, mtp_logits)``, each ``[B, T, V]``."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        h = self.norm(x)
        return self.head(h), self.head(self.mtp(h, self.embed(next_ids)))

    def update_bias(self, rate: float) -> None:
        for block in (*self.blocks, self.mtp.block):
            block.update_bias(rate)


def stages(model: DeepSeekForTraining, num_stages: int) -> list[nn.Module]:
    """``model`` cut into ``num_stages`` pipeline stages sharing its modules (layers spread as
    evenly as possible, earlier stages taking the remainder)."""
    layers = list(model.blocks)
    if num_stages < 2 or len(layers) < num_stages - 1:
        raise ValueError(
            f"num_stages={num_stages}: the model's {len(layers)} layers fit 2..{len(layers) + 1} "
            "stages (the last stage may hold only the head and MTP layer)"
        )
    per, extra = divmod(len(layers), num_stages)
    cuts, start = [], 0
    for s in range(num_stages):
        size = per + (1 if s < extra else 0)
        cuts.append(layers[start : start + size])
        start += size
    return [
        FirstStage(model.embed, cuts[0]),
        *(MiddleStage(c) for c in cuts[1:-1]),
        LastStage(cuts[-1], model.norm, model.head, model.embed, model.mtp),
    ]


def mtp_loss(
    logits: torch.Tensor,
    mtp_logits: torch.Tensor,
    labels: torch.Tensor,
    mtp_labels: torch.Tensor,
    weight: float,
) -> torch.Tensor:
    """DeepSeek-V3's training objective with one MTP depth: next-token cross-entropy plus
    ``weight`` (its lambda) times the MTP layer's cross-entropy on the token after next."""
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    extra = F.cross_entropy(mtp_logits.reshape(-1, vocab), mtp_labels.reshape(-1))
    return main + weight * extra
