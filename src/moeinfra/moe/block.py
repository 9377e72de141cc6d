"""A small DeepSeek-V3 decoder: blocks of MLA attention + MoE, split into the stages the overlap
schedules interleave (ATTN-0, ATTN-1 with the gate, SHARED, the routed MLP, the residual sum)."""

from __future__ import annotations

import torch
from torch import nn

from moeinfra.moe.config import MoEConfig
from moeinfra.moe.layers import MoE, RMSNorm
from moeinfra.moe.mla import MLA, KVCache, Segment, positions_of


class DecoderBlock(nn.Module):
    """``x [T, H] -> h + MoE(norm(h))`` with ``h = x + MLA(norm(x))``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = MLA(config)
        self.moe_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe = MoE(config)

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), segments)
        return finish(h, self.moe(self.moe_norm(h)))

    # Stages used by the schedules; forward() is their composition.
    def attn0(self, x: torch.Tensor, segments: list[Segment]):
        return self.attn.project(self.attn_norm(x), positions_of(segments, x.device))

    def attn1(self, x: torch.Tensor, projected, segments: list[Segment], cache: KVCache):
        """Core attention + residual + MoE norm + gate -> ``(h, hn, weights, indices)``."""
        h = x + self.attn.attend(projected, segments, cache)
        hn = self.moe_norm(h)
        weights, indices = self.moe.gate(hn)
        return h, hn, weights, indices


def finish(h: torch.Tensor, moe_out: torch.Tensor) -> torch.Tensor:
    """Residual sum after the MoE (one place, so every schedule adds in the same order)."""
    return h + moe_out


class Decoder(nn.Module):
    """``num_layers`` decoder blocks (the model the overlap schedules run)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, segments)
        return x


def build_decoder(config: MoEConfig, seed: int = 0) -> Decoder:
    """A decoder with weights drawn from ``seed`` (identical on every rank); gate biases non-zero."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Decoder(config)
        for block in model.blocks:
            block.moe.gate.bias.uniform_(-0.05, 0.05)
    return model
