"""DeepSeek's multi-token-prediction (MTP) layer, run as the draft model of speculative decoding.

DeepSeek-V3 and V3.2 ship one MTP layer after the decoder layers (``model.layers.{num_hidden_layers}
.*``): its own copies of the embedding (``embed_tokens``) and LM head (``shared_head.head``) with a
norm before it (``shared_head.norm``), two input norms (``enorm``, ``hnorm``), ``eh_proj`` and one
full decoder layer (MLA — with an indexer in V3.2 — and MoE). At position ``i`` it reads the target
model's final hidden state ``h_i`` (after the final norm) and the embedding of the next token
``t_{i+1}`` and predicts ``t_{i+2}``::

    g_i = block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))     logits = head(norm(g_i))

The embedding is zeroed at position 0, and for a second draft the layer is run again on its own
output ``g`` in place of ``h`` — both as vLLM's ``DeepSeekMTP`` (and SGLang's NextN) run the released
weights. Its MLA cache is one more layer of the engine's paged cache, at the same slots as the
target's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moeinfra.engine.checkpoint import CheckpointReader
from moeinfra.engine.hf_config import ModelConfig
from moeinfra.engine.kv_cache import KVLayout, LayerCache
from moeinfra.engine.models.deepseek_v3 import (
    MoEBlock,
    attention_names,
    load_attention,
    load_module,
    moe_layer,
    to_dtype,
)
from moeinfra.eplb import Plan
from moeinfra.moe.comm import Communicator
from moeinfra.moe.expert_parallel import ExpertParallelMoE
from moeinfra.moe.layers import Linear, RMSNorm
from moeinfra.moe.mla import Segment, positions_of
from moeinfra.moe.runtime import ExpertParallelDecoder

# Hugging Face name (under model.layers.{num_hidden_layers}.) -> MTP parameter
_OWN = {
    "embed_tokens.weight": "embed.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
    "shared_head.head.weight": "head.weight",
}


class MTP(nn.Module):
    """This rank's MTP layer: every dense weight and the routed experts of its EP slots."""

    def __init__(self, config: ModelConfig, layer: ExpertParallelMoE, comm: Communicator) -> None:
        super().__init__()
        block, hidden = config.block, config.block.hidden_size
        self.embed = nn.Embedding(config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, block.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, block.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.block = MoEBlock(block, layer.gate, config.indexer)
        self.moe = layer
        self.decoder = ExpertParallelDecoder.from_layers(
            nn.ModuleList([self.block]), nn.ModuleList([layer]), comm
        )
        self.norm = RMSNorm(hidden, block.rms_norm_eps)
        self.head = Linear(hidden, config.vocab_size)

    @torch.no_grad()
    def forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        segments: list[Segment],
        cache: LayerCache,
    ) -> torch.Tensor:
        """``hidden [T, H]`` (the target's final hidden state, or this layer's output for a later
        draft) and ``next_ids [T]`` (the token after each position) laid out as ``segments`` ->
        ``[T, H]``. Collective on the unit (its MoE layer), even with no tokens."""
        embedded = self.embed(next_ids)
        first = positions_of(segments, hidden.device) == 0
        embedded = embedded.masked_fill(first[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.decoder(x, segments, "none", [cache])

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` MTP outputs -> float32 draft logits ``[N, vocab]``."""
        return self.head(self.norm(hidden)).float()


def with_mtp_layer(layout: KVLayout) -> KVLayout:
    """``layout`` with one more layer: the MTP layer's MLA cache, at the same slots (what a unit
    that drafts caches, hands off and stores on disk)."""
    return dataclasses.replace(layout, num_layers=layout.num_layers + 1)


def load_mtp(
    reader: CheckpointReader,
    config: ModelConfig,
    plan: Plan,
    comm: Communicator,
    dtype: torch.dtype = torch.float32,
    keep_fp8: bool = False,
) -> MTP:
    """This rank's MTP layer (the first, ``model.layers.{num_hidden_layers}``) from ``reader``;
    ``plan`` (one layer) places its routed experts. See
    :func:`~moeinfra.engine.registry.require_mtp` for a checkpoint without one."""
    index = config.num_layers
    prefix = f"model.layers.{index}."
    layer = moe_layer(reader, config, plan, 0, index, comm, dtype, keep_fp8)
    mtp = to_dtype(MTP(config, layer, comm), dtype)
    load_attention(mtp.block, reader, attention_names(config), prefix, keep_fp8)
    load_module(mtp, reader, _OWN, prefix)
    return mtp
