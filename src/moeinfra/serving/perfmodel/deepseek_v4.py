"""DeepSeek-V4's cost terms: every layer MoE, its attention by layer kind — a sliding window, plus
compressed entries chosen by an indexer (CSA) or all of them, heavily compressed (HCA) — on
FlashMLA's sparse kernels; mHC's residual streams; FP4 routed experts. What it assumes rather than
takes from a published kernel figure: :data:`V4_ASSUMPTIONS`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moeinfra.serving.arch import CSA
from moeinfra.serving.perfmodel.breakdown import DecodeParts, overlapped
from moeinfra.serving.perfmodel.registry import CostTerms
from moeinfra.serving.specs import FP4_BYTES_PER_WEIGHT, ModelSpec

if TYPE_CHECKING:
    from moeinfra.serving.perfmodel.step import PerfModel

#: What the DeepSeek-V4 model assumes rather than takes from a published kernel figure (also in
#: docs/serving-model.md, "DeepSeek-V4 in the performance model").
V4_ASSUMPTIONS = (
    "core attention at FlashMLA's sparse kernels' H800 rates (410 TFLOPS decode, 640 prefill), "
    "the kernels vLLM runs V4 on; their V4 figures are not published",
    "the indexer's FP4 logits at the FP8 GEMM rate (Hopper has no FP4 tensor cores)",
    "V4's projections, compressors, mHC and FP4xFP8 experts at the FP8 roofline with DeepGEMM's "
    "1,350 TFLOPS share (its published table holds V3's shapes only)",
    "DeepEP's low-latency times scaled by the hidden size over V3's 7,168",
)


def projections(perf: PerfModel, tokens, sm_fraction: float = 1.0):
    """Seconds of the weight GEMMs every V4 layer runs for ``tokens`` rows, at the roofline of
    :meth:`~.roofline.Roofline._gemm` (DeepGEMM's table holds V3's shapes, not these): wq_a,
    wq_b, wkv and the grouped output projection wo_a, wo_b in FP8, and the two mHC mixing
    projections in float32 (TF32 runs at a quarter of the FP8 peak: 4x the FP8 FLOPs, 4 bytes a
    weight)."""
    m, a = perf.model, perf.model.arch
    d, h, c, r = m.hidden, m.num_heads, a.head_dim, a.o_lora_rank
    fp8 = d * m.q_lora_rank + m.q_lora_rank * h * c + d * c + h * c * r + a.o_groups * r * d
    mhc = 2 * (2 + a.hc_mult) * a.hc_mult * a.hc_mult * d
    return perf._gemm(2 * tokens * fp8, fp8, sm_fraction) + perf._gemm(
        4 * 2 * tokens * mhc, 4 * mhc, sm_fraction
    )


def routed(perf: PerfModel, phase: str, tokens, sm_fraction: float = 1.0):
    """Seconds of the heaviest GPU's routed experts for ``tokens`` tokens per GPU, alike in both
    phases: FP4 weights times FP8 activations at the FP8 peak ("the peak FLOPs for FP4 x FP8
    operations are currently the same as FP8 x FP8", DeepSeek-V4 report, section 1) x
    ``Efficiency.gemm``, against reading every slot's FP4 weights once
    (:data:`~moeinfra.serving.specs.FP4_BYTES_PER_WEIGHT`)."""
    m = perf.model
    rows = tokens * m.experts_per_token * perf.balance.imbalance
    weights = perf._slots * m.expert_params
    return perf._gemm(2 * rows * m.expert_params, weights * FP4_BYTES_PER_WEIGHT, sm_fraction)


def layer(
    perf: PerfModel,
    kind: str,
    tokens,
    context,
    requests=None,
    sm_fraction: float = 1.0,
    key_tokens=None,
):
    """(core attention, compressor + indexer) seconds of one V4 layer of ``kind`` for
    ``tokens`` query rows at ``context`` tokens each (broadcasts). Core attention: each head
    scores and sums ``min(context, sliding_window)`` window entries and the compressed ones
    (CSA: ``min(context / 4, index_topk)``, HCA: ``context / 128``), ``4 x head_dim`` BF16
    FLOPs per head and entry, at FlashMLA's sparse kernels' share of the BF16 peak (vLLM runs
    V4's attention on them: ``vllm/models/deepseek_v4/nvidia/flashmla.py``); decoding
    (``requests`` given) reads the window and HCA's entries once per request and a CSA query's
    chosen entries per query; prefill reads the entries of the ``key_tokens`` earlier tokens
    once for the micro-batch (default :meth:`~.indexer.IndexerKernels.prefill_key_tokens`; the
    window: the micro-batch's own tokens and one window before them; CSA: at most the entries its
    queries choose, the per-query gather of the sparse kernel served from L2, as V3.2's sparse
    prefill is modelled). Compressor: its BF16 projections (wkv, wgate; x2 the FP8 FLOPs and
    bytes). CSA's indexer: its projections, the logits of every query
    against every compressed index key at the FP8 GEMM rate (V4 multiplies them in FP4;
    Hopper has no FP4 tensor cores, and no FP4 rate is assumed on other parts either) against
    reading the index keys (in prefill each once for the micro-batch, in decode each
    request's) and writing float32 logits, and the top-k reading them (HBM-bound;
    :meth:`~.indexer.IndexerKernels._index_scores`, as V3.2's)."""
    m, a, eff = perf.model, perf.model.arch, perf.eff
    d, h, c = m.hidden, m.num_heads, a.head_dim
    ratio = dict(zip(a.layer_kinds, a.compress_ratios, strict=True)).get(kind, 0)
    context = np.asarray(context, dtype=np.float64)
    window = np.minimum(context, a.sliding_window)
    entries = context / ratio if ratio else 0.0 * context
    chosen = np.minimum(entries, m.index_topk) if kind == CSA else entries
    flops = 4 * h * c * tokens * (window + chosen)
    entry = a.entry_bytes(m.kv_cache_dtype)
    if requests is None:
        factor, compute = eff.attention_time, eff.sparse_prefill_compute
        if key_tokens is None:
            key_tokens = perf.prefill_key_tokens(tokens, context)
        # compressed entries (and CSA's index keys) of the earlier tokens, each read once
        index_keys_read = entries_read = key_tokens / ratio if ratio else 0.0 * key_tokens
        if kind == CSA:  # at most what the queries choose
            entries_read = np.minimum(entries_read, tokens * chosen)
        window_read = np.minimum(key_tokens, tokens + a.sliding_window)
        read = entry * (window_read + entries_read)
    else:
        factor, compute = eff.decode_attention_time, eff.sparse_decode_compute
        once = window + (0.0 if kind == CSA else entries)
        read = entry * (requests * once + (tokens * chosen if kind == CSA else 0.0))
        index_keys_read = requests * entries
    core = perf._attention(factor, flops, read, sm_fraction, compute)
    extra = 0.0 * core
    if ratio:
        coff = 2 if kind == CSA else 1
        weights = 2 * d * coff * c
        extra = extra + perf._gemm(2 * 2 * tokens * weights, 2 * weights, sm_fraction)
    if kind == CSA:
        ih, ic = m.index_n_heads, m.index_head_dim
        fp8 = m.q_lora_rank * ih * ic
        bf16 = d * ih + 2 * d * 2 * ic  # weights_proj, its compressor's wkv and wgate
        extra = extra + perf._gemm(2 * tokens * fp8, fp8, sm_fraction)
        extra = extra + perf._gemm(2 * 2 * tokens * bf16, 2 * bf16, sm_fraction)
        key_bytes = a.index_key_bytes(m.kv_cache_dtype)
        extra = extra + perf._index_scores(tokens, entries, index_keys_read, key_bytes, sm_fraction)
    return core, extra


def layer_values(model: ModelSpec, by_kind: dict) -> np.ndarray:
    """``[layers]``: each layer's value of a ``{layer kind: seconds}`` term."""
    return np.array([float(by_kind[k]) for k in model.layer_kinds()])


def prefill_attention(perf: PerfModel, nb, keys, cached_per_token, sm, combine):
    """(projections, core attention [layers], compressor + indexer [layers]) seconds of a V4
    prefill micro-batch of ``nb`` tokens at ``keys`` tokens of context each (the window and
    compressed entries of :func:`layer`, the cache read once for the micro-batch:
    :meth:`~.indexer.IndexerKernels.prefill_key_tokens`), the core attention beside the other
    micro-batch's combine as :func:`.deepseek_v3.prefill_attention` runs it."""
    proj = float(projections(perf, nb, sm))
    core, extra = {}, {}
    read = perf.prefill_key_tokens(nb, keys, cached_per_token)
    for kind in set(perf.model.layer_kinds()):
        # on every SM, then slowed
        full = float(layer(perf, kind, nb, keys, key_tokens=read)[0])
        extra[kind] = float(layer(perf, kind, nb, keys, sm_fraction=sm, key_tokens=read)[1])
        core[kind] = float(perf._beside_all_to_all(full, sm, combine - proj - extra[kind]))
    return proj, layer_values(perf.model, core), layer_values(perf.model, extra)


def decode_attention(perf: PerfModel, tokens, kv, requests):
    """({layer kind: core attention}, {layer kind: compressor + indexer}) of ``tokens`` queries of
    ``requests`` requests at ``kv`` cached tokens each (:func:`layer`)."""
    core, extra = {}, {}
    for kind in set(perf.model.layer_kinds()):
        core[kind], extra[kind] = layer(perf, kind, tokens, kv, requests=requests)
    return core, extra


def decode_layers_s(perf: PerfModel, mb: int, parts: DecodeParts):
    """Every layer MoE, its attention by layer kind."""
    p, kinds = parts, perf.model.layer_kinds()
    layers = 0.0
    for kind in dict.fromkeys(kinds):  # a fixed order: the same last bit
        attention = p.attn_proj + p.core_attn[kind] + p.indexer[kind] + p.gate
        count = kinds.count(kind)
        layers = layers + count * overlapped(
            mb, attention, p.shared + p.routed, p.dispatch, p.combine
        )
    return layers


def attention_weight(perf: PerfModel, keys):
    """A token's core attention and indexer seconds over its layers per token of a micro-batch of
    the unit's size (:func:`layer`; what it reads once for the micro-batch, the weights and the
    cache, shared by its tokens)."""
    kinds = perf.model.layer_kinds()
    nb = perf.dep.tokens_per_gpu / perf.dep.micro_batches
    # in the schedule's order (a set's order varies with the hash seed, and so would the
    # sum's last bit, which the planner's queue simulation can amplify)
    order = dict.fromkeys(kinds)
    per_kind = {k: sum(layer(perf, k, nb, keys)) / nb for k in order}
    return sum(kinds.count(k) * per_kind[k] for k in order)


def weight_bytes(model: ModelSpec, slots_per_gpu: int) -> float:
    """Weights on one GPU: the routed experts in FP4 (:data:`FP4_BYTES_PER_WEIGHT`); the
    attention, compressors, indexer, router and mHC at one byte a weight, as V3's are."""
    m = model
    parts = m.arch.params().parts
    per_layer = sum(
        parts.get(k, 0) for k in ("attention", "indexer", "compressor", "router", "norms_and_mhc")
    )
    return float(
        per_layer * m.num_layers / m.arch.num_layers
        + m.num_moe_layers * m.num_shared_experts * m.expert_params
        + m.num_moe_layers * slots_per_gpu * m.expert_params * FP4_BYTES_PER_WEIGHT
        + 2 * m.hidden * m.vocab
    )


def activation_bytes(model: ModelSpec, tokens: float) -> float:
    """mHC's ``hc_mult`` residual streams and the normalised hidden state, and per head one query
    and one output of ``head_dim`` (BF16), of ``tokens`` tokens."""
    m = model
    residual = (m.arch.hc_mult + 1) * tokens * m.hidden * 2
    return residual + tokens * m.num_heads * 2 * m.arch.head_dim * 2


COSTS = CostTerms(
    "deepseek_v4",
    prefill_attention=prefill_attention,
    decode_attention=decode_attention,
    layer_values=layer_values,
    decode_layers_s=decode_layers_s,
    decode_projections=projections,
    routed=routed,
    attention_weight=attention_weight,
    weight_bytes=weight_bytes,
    activation_bytes=activation_bytes,
)
