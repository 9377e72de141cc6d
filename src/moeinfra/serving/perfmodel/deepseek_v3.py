"""DeepSeek-V3's cost terms (V3.1 and R1 have its shape): MLA with dense attention — its MHA mode
in prefill, the absorbed MQA mode over the latent cache in decode — FP8 experts on DeepGEMM's
grouped kernels, and dense MLPs in the first ``num_dense_layers`` layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moeinfra.serving.perfmodel.breakdown import DecodeParts, overlapped
from moeinfra.serving.perfmodel.registry import CostTerms
from moeinfra.serving.specs import ModelSpec

if TYPE_CHECKING:
    from moeinfra.serving.perfmodel.step import PerfModel


def mla_projections(perf: PerfModel, tokens, up_tokens, sm_fraction: float = 1.0):
    """The four MLA projection GEMMs for ``tokens`` rows; the kv up-projection runs on
    ``up_tokens`` rows (prefill adds the cached prefix, whose latent KV is up-projected)."""
    m = perf.model
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return (
        perf._deepgemm(
            "mla_down",
            tokens,
            m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim,
            m.hidden,
            sm_fraction,
        )
        + perf._deepgemm("q_up", tokens, m.num_heads * qk, m.q_lora_rank, sm_fraction)
        + perf._deepgemm(
            "kv_up",
            up_tokens,
            m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
            m.kv_lora_rank,
            sm_fraction,
        )
        + perf._deepgemm("attn_out", tokens, m.hidden, m.num_heads * m.v_head_dim, sm_fraction)
    )


def decode_projections(perf: PerfModel, tokens):
    """MLA's projections in decode: the absorbed form folds the kv up-projection into q and the
    output, with the same FLOPs and weights."""
    return mla_projections(perf, tokens, tokens)


def routed(perf: PerfModel, phase: str, tokens, sm_fraction: float = 1.0):
    """The heaviest GPU's routed experts for ``tokens`` tokens per GPU on DeepGEMM's grouped
    kernels: contiguous in prefill, masked in decode."""
    kind = "_contiguous" if phase == "prefill" else "_masked"
    return perf._experts(kind, perf._rows_per_expert(tokens), perf._slots, sm_fraction)


def mha_prefill(perf: PerfModel, tokens: float, keys: float, cached_per_token: float, sm: float):
    """(projections, core attention on every SM, reading the latent KV) seconds of MLA's MHA mode
    for a prefill micro-batch of ``tokens`` tokens attending to ``keys`` keys each: the cached
    prefix' latent KV is up-projected beside the new tokens'
    (:attr:`~moeinfra.serving.perfmodel.efficiency.Efficiency.mha_prefill_compute`)."""
    m, eff = perf.model, perf.eff
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    up_tokens = tokens * (1 + cached_per_token)
    kv_bytes = up_tokens * m.latent_bytes_per_token_layer
    proj = mla_projections(perf, tokens, up_tokens, sm)
    # the roofline's two sides: compute on every SM, and reading the KV (which the SM share
    # does not slow)
    mha_flops = 2 * m.num_heads * (qk + m.v_head_dim) * tokens * keys
    mha = perf._attention(eff.attention_time, mha_flops, 0.0, compute=eff.mha_prefill_compute)
    read = perf._attention(eff.attention_time, 0.0, kv_bytes)
    return proj, mha, read


def prefill_attention(perf: PerfModel, nb, keys, cached_per_token, sm, combine):
    """(MLA projections, core attention, no indexer) seconds of a prefill micro-batch of ``nb``
    tokens attending to ``keys`` keys each in MHA mode (:func:`mha_prefill`), beside the other
    micro-batch's combine (``combine`` seconds, which starts with this segment). The projections
    are GEMMs on the ``sm`` share; the core attention runs after them, on that share only while
    the combine lasts."""
    proj, mha, read = mha_prefill(perf, nb, keys, cached_per_token, sm)
    return proj, float(max(perf._beside_all_to_all(mha, sm, combine - proj), read)), None


def decode_attention(perf: PerfModel, tokens, kv, requests):
    """(core attention, no indexer) of ``tokens`` queries over their requests' ``kv`` cached
    latents each, in MQA mode; each of the ``requests`` reads its cache once."""
    m = perf.model
    core = perf._attention(
        perf.eff.decode_attention_time,
        2 * m.num_heads * (m.kv_values_per_token_layer + m.kv_lora_rank) * tokens * kv,
        requests * kv * m.latent_bytes_per_token_layer,
    )
    return core, None


def layer_values(model: ModelSpec, term):
    """Every MLA layer attends alike: one value serves them all."""
    return term


def decode_layers_s(perf: PerfModel, mb: int, parts: DecodeParts):
    """The MoE layers, each overlapping its micro-batches, and the dense layers before them."""
    m, p = perf.model, parts
    attention = p.attn_proj + p.core_attn + p.gate
    moe_layer = overlapped(mb, attention, p.shared + p.routed, p.dispatch, p.combine)
    dense_layer = mb * (p.attn_proj + p.core_attn + p.dense_mlp)
    return m.num_moe_layers * moe_layer + m.num_dense_layers * dense_layer


def attention_weight(perf: PerfModel, keys):
    """Dense attention's FLOPs per token grow as its ``keys``."""
    return keys


def weight_bytes(model: ModelSpec, slots_per_gpu: int) -> float:
    """FP8 weights on one GPU: attention, shared expert, routed slots, dense MLPs, head."""
    m = model
    return float(
        m.num_layers * m.attention_params
        + m.num_moe_layers * (m.num_shared_experts + slots_per_gpu) * m.expert_params
        + m.num_dense_layers * m.dense_mlp_params
        + 2 * m.hidden * m.vocab
    )


def activation_bytes(model: ModelSpec, tokens: float) -> float:
    """The residual and normalised hidden states and MLA's expanded queries, keys and values
    (BF16) of ``tokens`` tokens."""
    m = model
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return 2 * tokens * m.hidden * 2 + tokens * m.num_heads * (2 * qk + m.v_head_dim) * 2


COSTS = CostTerms(
    "deepseek_v3",
    prefill_attention=prefill_attention,
    decode_attention=decode_attention,
    layer_values=layer_values,
    decode_layers_s=decode_layers_s,
    decode_projections=decode_projections,
    routed=routed,
    attention_weight=attention_weight,
    weight_bytes=weight_bytes,
    activation_bytes=activation_bytes,
)
