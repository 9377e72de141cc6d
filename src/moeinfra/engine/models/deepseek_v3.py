"""DeepSeek-V3 (``model_type: deepseek_v3``): embedding, ``first_k_dense_replace`` dense layers, MoE
layers, final norm and LM head, built from :mod:`moeinfra.moe`'s MLA, gate, experts and expert-parallel
runtime, with attention over the paged MLA latent cache.

Checkpoint names are Hugging Face's (``model.layers.{i}.self_attn.q_a_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, ...). The multi-token-prediction layers that
DeepSeek-V3 ships after the last decoder layer (``model.layers.{num_hidden_layers}.*``) are not loaded:
the engine decodes one token per step.
"""

from __future__ import annotations

import torch
from torch import nn

from moeinfra.engine.attention import mla_layout, paged_mla_attention
from moeinfra.engine.checkpoint import CheckpointReader
from moeinfra.engine.fp8 import Fp8Linear
from moeinfra.engine.hf_config import IndexerConfig, ModelConfig, parse_config
from moeinfra.engine.indexer import Indexer
from moeinfra.engine.kv_cache import KVLayout, LayerCache, StepCache
from moeinfra.eplb import Plan
from moeinfra.moe.block import finish
from moeinfra.moe.comm import Communicator
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.expert_parallel import ExpertParallelMoE, rank_experts
from moeinfra.moe.gate import Gate
from moeinfra.moe.layers import Expert, Linear, RMSNorm
from moeinfra.moe.mla import MLA, Segment, positions_of
from moeinfra.moe.runtime import ExpertParallelDecoder

MODEL_TYPE = "deepseek_v3"

# Hugging Face name (under model.layers.{i}.) -> (module path in a block, parameter); the
# trainer (moeinfra.train) writes checkpoints by the same maps
HF_ATTENTION = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "moe_norm.weight",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attn.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attn.wkv_b.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
}
_INDEXER = {
    "self_attn.indexer.wq_b.weight": "indexer.wq_b.weight",
    "self_attn.indexer.wk.weight": "indexer.wk.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.weights_proj.weight",
}
HF_SWIGLU = {
    "gate_proj.weight": "w1.weight",
    "up_proj.weight": "w3.weight",
    "down_proj.weight": "w2.weight",
}


class _AttentionBlock(nn.Module):
    """MLA over the paged cache; with an ``indexer`` config (DeepSeek-V3.2), sparse: the layer's
    lightning indexer chooses which cached tokens each query attends to."""

    def __init__(self, config: MoEConfig, indexer: IndexerConfig | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = MLA(config)
        self.indexer = Indexer(config, indexer) if indexer is not None else None
        self.moe_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def attn0(self, x: torch.Tensor, segments: list[Segment]):
        """ATTN-0: the :class:`Latent` of ``x [T, H]`` (and the indexer's projections)."""
        xn, positions = self.attn_norm(x), positions_of(segments, x.device)
        if self.indexer is None:
            return self.attn.project_latent(xn, positions)
        q_latent = self.attn.q_latent(xn)
        latent = self.attn.project_latent(xn, positions, q_latent)
        return latent, self.indexer.project(xn, q_latent, self.attn.rotary.cis(positions))

    def attend(self, x: torch.Tensor, projected, segments: list[Segment], cache: LayerCache):
        """``x`` plus the attention output of ``projected`` (:meth:`attn0`'s)."""
        if self.indexer is None:
            return x + paged_mla_attention(self.attn, projected, segments, cache)
        latent, index = projected
        topk = self.indexer.config.topk
        return x + paged_mla_attention(self.attn, latent, segments, cache, index, topk)


class DenseBlock(_AttentionBlock):
    """A leading dense layer: MLA + a SwiGLU MLP of ``intermediate_size``."""

    def __init__(
        self, config: MoEConfig, intermediate_size: int, indexer: IndexerConfig | None = None
    ) -> None:
        super().__init__(config, indexer)
        self.mlp = Expert(config.hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor, segments: list[Segment], cache: LayerCache) -> torch.Tensor:
        h = self.attend(x, self.attn0(x, segments), segments, cache)
        return finish(h, self.mlp(self.moe_norm(h)))


class MoEBlock(_AttentionBlock):
    """An MoE layer's attention stages, in the interface the expert-parallel runtime schedules."""

    def __init__(self, config: MoEConfig, gate: Gate, indexer: IndexerConfig | None = None) -> None:
        super().__init__(config, indexer)
        self.gate = gate  # the same module as the expert-parallel layer's

    def attn1(self, x: torch.Tensor, projected, segments: list[Segment], cache: LayerCache):
        h = self.attend(x, projected, segments, cache)
        hn = self.moe_norm(h)
        weights, indices = self.gate(hn)
        return h, hn, weights, indices


class DeepseekV3(nn.Module):
    """This rank's DeepSeek-V3: every dense weight, and the routed experts of its EP slots."""

    def __init__(
        self, config: ModelConfig, plan: Plan, comm: Communicator, experts: nn.ModuleList
    ) -> None:
        super().__init__()
        c, block = config, config.block
        self.config = config
        self.embed = nn.Embedding(c.vocab_size, block.hidden_size)
        self.dense = nn.ModuleList(
            DenseBlock(block, c.intermediate_size, c.indexer)
            for _ in range(c.first_k_dense_replace)
        )
        self.moe_blocks = nn.ModuleList(MoEBlock(block, layer.gate, c.indexer) for layer in experts)
        self.moe = experts
        self.decoder = ExpertParallelDecoder.from_layers(self.moe_blocks, self.moe, comm)
        self.norm = RMSNorm(block.hidden_size, block.rms_norm_eps)
        self.lm_head = Linear(block.hidden_size, c.vocab_size)  # oneDNN on the CPU in float32
        self.plan = plan

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, segments: list[Segment], cache: StepCache, overlap: str
    ) -> torch.Tensor:
        """``input_ids [T]`` laid out as ``segments`` -> final hidden states ``[T, H]`` (normed)."""
        x = self.embed(input_ids)
        for i, block in enumerate(self.dense):
            x = block(x, segments, cache.layer(i))
        if len(self.moe_blocks):
            first = len(self.dense)
            caches = [cache.layer(first + j) for j in range(len(self.moe_blocks))]
            x = self.decoder(x, segments, overlap, caches)
        return self.norm(x)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` -> float32 logits ``[N, vocab]``."""
        return self.lm_head(hidden).float()


def kv_layout(config: ModelConfig, dtype: torch.dtype, block_size: int) -> KVLayout:
    """The latent and RoPE key per token and layer (and the index key with an indexer), whatever
    the ``block_size``."""
    index_dim = config.indexer.head_dim if config.indexer is not None else 0
    return mla_layout(config.block, config.num_layers, dtype, index_dim)


def load_module(
    module: nn.Module,
    reader: CheckpointReader,
    names: dict[str, str],
    prefix: str,
    keep_fp8: bool = False,
):
    """Copy checkpoint tensors ``prefix + hf_name`` into ``module``'s ``ours`` parameters; with
    ``keep_fp8``, a linear layer stored in FP8 becomes an :class:`Fp8Linear` holding it as stored."""
    params = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    for hf_name, ours in names.items():
        target = params[ours]
        # wkv_b is only read as the absorbed per-head matrices, dequantised once here (as vLLM
        # keeps W_UK and W_UV), never as a GEMM over activations
        fp8_gemm = keep_fp8 and not hf_name.endswith("kv_b_proj.weight")
        stored = reader.fp8(prefix + hf_name) if fp8_gemm else None
        if stored is not None and ours.endswith(".weight"):
            path = ours.removesuffix(".weight")
            parent, _, leaf = path.rpartition(".")
            owner = module.get_submodule(parent) if parent else module
            if tuple(stored[0].shape) != tuple(target.shape):
                reader.get(prefix + hf_name, tuple(target.shape))  # raises, naming both shapes
            setattr(owner, leaf, Fp8Linear(*stored))
            continue
        with torch.no_grad():
            target.copy_(reader.get(prefix + hf_name, tuple(target.shape), target.dtype))


def to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` except FP8 layers, which keep their stored dtypes."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            continue
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is not None and t.is_floating_point() and t.dtype != dtype:
                    t.data = t.data.to(dtype)
    return model


def _expert(block: MoEConfig, size: int, reader, prefix: str, dtype, keep_fp8: bool) -> Expert:
    module = Expert(block.hidden_size, size).to(dtype)
    load_module(module, reader, HF_SWIGLU, prefix, keep_fp8)
    return module


def attention_names(config: ModelConfig) -> dict[str, str]:
    return dict(HF_ATTENTION) | (_INDEXER if config.indexer is not None else {})


def load_attention(block, reader, names: dict[str, str], prefix: str, keep_fp8: bool) -> None:
    if block.indexer is not None:  # its head weights stay float32 (DeepSeek, transformers)
        block.indexer.weights_proj.float()
    load_module(block, reader, names, prefix, keep_fp8)


def moe_layer(
    reader: CheckpointReader,
    config: ModelConfig,
    plan: Plan,
    j: int,
    layer: int,
    comm: Communicator,
    dtype: torch.dtype,
    keep_fp8: bool,
) -> ExpertParallelMoE:
    """Checkpoint layer ``layer``'s gate, shared expert and the routed experts of this rank's
    slots in row ``j`` of ``plan``, as an expert-parallel layer."""
    block, prefix = config.block, f"model.layers.{layer}.mlp."
    gate = Gate(block).to(dtype)
    load_module(
        gate, reader, {"gate.weight": "weight", "gate.e_score_correction_bias": "bias"}, prefix
    )
    shared = None
    if block.num_shared_experts:
        size = block.num_shared_experts * block.moe_intermediate_size
        shared = _expert(block, size, reader, prefix + "shared_experts.", dtype, keep_fp8)
    experts = {
        e: _expert(
            block, block.moe_intermediate_size, reader, f"{prefix}experts.{e}.", dtype, keep_fp8
        )
        for e in rank_experts(plan, j, comm.rank)
    }
    return ExpertParallelMoE.from_experts(block, gate, shared, experts, plan, j, comm)


def load(
    reader: CheckpointReader,
    config: ModelConfig,
    plan: Plan,
    comm: Communicator,
    dtype: torch.dtype = torch.float32,
    keep_fp8: bool = False,
) -> DeepseekV3:
    """Build this rank's model from ``reader``: only the routed experts ``plan`` gives the rank.
    ``keep_fp8``: projections stored in FP8 stay FP8 (:class:`Fp8Linear`), else are dequantised
    to ``dtype``."""
    if plan.num_layers != config.num_moe_layers:
        raise ValueError(
            f"plan has {plan.num_layers} layers, the model has {config.num_moe_layers} MoE layers"
        )
    moe_layers = nn.ModuleList(
        moe_layer(reader, config, plan, j, config.first_k_dense_replace + j, comm, dtype, keep_fp8)
        for j in range(config.num_moe_layers)
    )
    model = to_dtype(DeepseekV3(config, plan, comm, moe_layers), dtype)
    for i, dense in enumerate(model.dense):
        names = attention_names(config) | {f"mlp.{k}": f"mlp.{v}" for k, v in HF_SWIGLU.items()}
        load_attention(dense, reader, names, f"model.layers.{i}.", keep_fp8)
    for j, moe_block in enumerate(model.moe_blocks):
        layer = config.first_k_dense_replace + j
        load_attention(
            moe_block, reader, attention_names(config), f"model.layers.{layer}.", keep_fp8
        )
    load_module(
        model,
        reader,
        {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"},
        "",
    )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    else:
        load_module(model, reader, {"lm_head.weight": "lm_head.weight"}, "")
    return model


__all__ = ["MODEL_TYPE", "DeepseekV3", "kv_layout", "load", "parse_config"]
