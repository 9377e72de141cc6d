"""DeepSeek-V3.2's cost terms: DeepSeek-V3 (:mod:`.deepseek_v3`) with DeepSeek Sparse Attention —
a lightning indexer picks each query's ``index_topk`` keys, and MLA attends to those alone in MQA
mode on FlashMLA's sparse kernels (or, for short prompts, MHA mode with the selection as a mask)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from moeinfra.serving.perfmodel import deepseek_v3
from moeinfra.serving.perfmodel.breakdown import DecodeParts

if TYPE_CHECKING:
    from moeinfra.serving.perfmodel.step import PerfModel


def indexer(perf: PerfModel, queries, keys, key_tokens, sm_fraction: float = 1.0):
    """Seconds of the lightning indexer for ``queries`` query tokens each scoring ``keys``
    earlier tokens, whose index keys (``key_tokens`` of them, read once) come from the cache,
    in three kernels one after another as DeepSeek's inference code runs them: the
    projections (FP8 GEMMs: q_lora_rank -> heads x dim, hidden -> dim, hidden -> heads); the
    logits and the top-k (:meth:`~.indexer.IndexerKernels._index_scores`). Broadcasts."""
    m = perf.model
    projections = perf._gemm(2 * queries * m.indexer_params, m.indexer_params, sm_fraction)
    key_bytes = m.index_key_bytes_per_token_layer
    return projections + perf._index_scores(queries, keys, key_tokens, key_bytes, sm_fraction)


def sparse_mla(perf: PerfModel, factor: float, queries, keys, bytes_read, compute: float, sm=1.0):
    """Seconds of MLA in MQA mode (the absorbed form: 576-dimensional keys, 512-dimensional
    values shared by every head) for ``queries`` queries over ``min(keys, index_topk)`` keys
    each; FlashMLA's sparse kernels' ``compute`` share of the BF16 peak."""
    m = perf.model
    selected = np.minimum(keys, m.index_topk)
    flops = 2 * m.num_heads * (m.kv_values_per_token_layer + m.kv_lora_rank) * queries
    return perf._attention(factor, flops * selected, bytes_read, sm, compute)


def prefill_attention(perf: PerfModel, nb, keys, cached_per_token, sm, combine):
    """(MLA projections, core attention, indexer) seconds of a prefill micro-batch of ``nb``
    tokens attending to ``keys`` keys each, beside the other micro-batch's combine (``combine``
    seconds, which starts with this segment): the indexer, and the cheaper of DeepSeek's two
    kernels — MLA's MQA mode over the ``index_topk`` selected keys (FlashMLA's sparse prefill; no
    up-projection of the prefix) or, for short contexts, MHA mode over all of them with the
    selection as a mask (the report's "masked MHA mode"). Projections and indexer are GEMMs on
    the ``sm`` share; the core attention runs after them, on that share only while the combine
    lasts."""
    eff = perf.eff
    proj, mha, read = deepseek_v3.mha_prefill(perf, nb, keys, cached_per_token, sm)
    index = float(indexer(perf, nb, keys, perf.prefill_key_tokens(nb, keys, cached_per_token), sm))
    core = float(max(perf._beside_all_to_all(mha, sm, combine - proj - index), read))
    sparse_proj = deepseek_v3.mla_projections(perf, nb, nb, sm)
    sparse = sparse_mla(perf, eff.attention_time, nb, keys, 0.0, eff.sparse_prefill_compute)
    sparse = float(max(perf._beside_all_to_all(sparse, sm, combine - sparse_proj - index), read))
    if sparse_proj + sparse < proj + core:
        return sparse_proj, sparse, index
    return proj, core, index


def decode_attention(perf: PerfModel, tokens, kv, requests):
    """(core attention, indexer) of ``tokens`` queries over their requests' ``kv`` cached tokens:
    each query reads its ``index_topk`` selected latents, each of the ``requests`` its index keys
    once."""
    m, eff = perf.model, perf.eff
    core = sparse_mla(
        perf,
        eff.decode_attention_time,
        tokens,
        kv,
        tokens * np.minimum(kv, m.index_topk) * m.latent_bytes_per_token_layer,
        eff.sparse_decode_compute,
    )
    return core, indexer(perf, tokens, kv, requests * kv)


def decode_layers_s(perf: PerfModel, mb: int, parts: DecodeParts):
    """DeepSeek-V3's layers (:func:`.deepseek_v3.decode_layers_s`), the indexer before each
    core attention."""
    core = parts.core_attn + parts.indexer
    return deepseek_v3.decode_layers_s(perf, mb, parts._replace(core_attn=core))


def attention_weight(perf: PerfModel, keys):
    """The compute seconds per token and layer of the indexer's logits, which grow with the
    ``keys``, plus the cheaper core-attention mode, whose selected keys stop at ``index_topk``."""
    m, hw, eff = perf.model, perf.hw, perf.eff
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    bf16 = hw.bf16_tflops * 1e12
    mha = 2 * m.num_heads * (qk + m.v_head_dim) * keys / (bf16 * eff.mha_prefill_compute)
    mqa = (
        2
        * m.num_heads
        * (m.kv_values_per_token_layer + m.kv_lora_rank)
        * np.minimum(keys, m.index_topk)
        / (bf16 * eff.sparse_prefill_compute)
    )
    logits = 2 * m.index_n_heads * m.index_head_dim * keys / (hw.fp8_tflops * 1e12 * eff.gemm)
    top_k = 4 * keys / (hw.hbm_tb_per_s * 1e12 * eff.memory)
    return eff.attention_time * np.minimum(mha, mqa) + eff.gemm_time * logits + top_k


COSTS = replace(
    deepseek_v3.COSTS,
    model_type="deepseek_v32",
    prefill_attention=prefill_attention,
    decode_attention=decode_attention,
    decode_layers_s=decode_layers_s,
    attention_weight=attention_weight,
)
