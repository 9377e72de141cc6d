"""Per-layer, per-step time of a prefill or decode unit (formulas in docs/serving-model.md).

Every operation is a roofline: ``max(FLOPs / (peak * efficiency), bytes / (bandwidth * efficiency))``.
The achieved-efficiency factors in :class:`Efficiency` are few, derived from DeepSeek's published kernel
figures, and shared by every scenario.

* :mod:`.step` — :class:`PerfModel`, the step model every architecture shares.
* :mod:`.registry` — each architecture's :class:`CostTerms` by ``config.json``'s ``model_type``:
  :mod:`.deepseek_v3`, :mod:`.deepseek_v32`, :mod:`.deepseek_v4`, one module each.
* :mod:`.breakdown` — a step's parts (:class:`LayerBreakdown`) and how a layer's parts overlap.
* :mod:`.roofline`, :mod:`.indexer`, :mod:`.all_to_all` — the kernels the terms are built of.
* :mod:`.efficiency` — :class:`Efficiency` and the published kernel figures behind it.
* :mod:`.memory` — what a GPU of a unit holds, and whether it fits.
* :mod:`.measured_kernels` — measured kernel tables in place of first-principles parts.
"""

from moeinfra.serving.perfmodel.all_to_all import (
    COMBINE_BYTES_PER_TOKEN,
    DISPATCH_BYTES_PER_TOKEN,
    token_bytes,
)
from moeinfra.serving.perfmodel.breakdown import INDEXER, PARTS, DecodeParts, LayerBreakdown
from moeinfra.serving.perfmodel.deepseek_v4 import V4_ASSUMPTIONS
from moeinfra.serving.perfmodel.efficiency import (
    DEEPGEMM_H800_TFLOPS,
    DEFAULT_EFFICIENCY,
    H800_FP8_TFLOPS,
    MHA_PREFILL_SHARE,
    MHA_TRACE_FLOPS,
    MHA_TRACE_SECONDS,
    MHA_TRACE_SMS,
    TIME_TERMS,
    Efficiency,
)
from moeinfra.serving.perfmodel.memory import DECODE_ACTIVATION_BATCH, MAX_CONTEXT_TOKENS, MemoryUse
from moeinfra.serving.perfmodel.registry import CostTerms, cost_terms, register
from moeinfra.serving.perfmodel.step import PerfModel

__all__ = [
    "COMBINE_BYTES_PER_TOKEN",
    "DECODE_ACTIVATION_BATCH",
    "DEEPGEMM_H800_TFLOPS",
    "DEFAULT_EFFICIENCY",
    "DISPATCH_BYTES_PER_TOKEN",
    "H800_FP8_TFLOPS",
    "INDEXER",
    "MAX_CONTEXT_TOKENS",
    "MHA_PREFILL_SHARE",
    "MHA_TRACE_FLOPS",
    "MHA_TRACE_SECONDS",
    "MHA_TRACE_SMS",
    "PARTS",
    "TIME_TERMS",
    "V4_ASSUMPTIONS",
    "CostTerms",
    "DecodeParts",
    "Efficiency",
    "LayerBreakdown",
    "MemoryUse",
    "PerfModel",
    "cost_terms",
    "register",
    "token_bytes",
]
