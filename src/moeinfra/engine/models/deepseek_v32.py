"""DeepSeek-V3.2 (``model_type: deepseek_v32``): DeepSeek-V3 plus DeepSeek Sparse Attention.

Every layer's MLA gains a lightning indexer (``model.layers.{i}.self_attn.indexer.{wq_b, wk,
k_norm, weights_proj}``, :mod:`moeinfra.engine.indexer`) whose key is cached beside the latent and
the RoPE key; a query with more than ``index_topk`` earlier tokens attends to the ``index_topk`` the
indexer scores best, gathered from the paged cache (:func:`~moeinfra.engine.attention.
paged_mla_attention`). Everything else — MoE, gate, MLA, loading, FP8 — is DeepSeek-V3's
(:mod:`.deepseek_v3`). ``config.json``'s ``head_dim`` (transformers writes ``qk_rope_head_dim``
there) is not read.
"""

from __future__ import annotations

import dataclasses

from moeinfra.engine.hf_config import IndexerConfig, ModelConfig
from moeinfra.engine.hf_config import parse_config as parse_v3_config
from moeinfra.engine.models.deepseek_v3 import DeepseekV3, kv_layout, load
from moeinfra.errors import CheckpointError

MODEL_TYPE = "deepseek_v32"
# DeepSeek's V3.2 FP8 release writes scale_fmt "ue8m0": block scales are powers of two, stored as
# float32 — read as any other scale.
SCALE_FORMATS = (None, "ue8m0")


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """DeepSeek-V3's :class:`ModelConfig` with the indexer's ``index_n_heads``,
    ``index_head_dim`` and ``index_topk``."""
    config = parse_v3_config(raw, source)
    scale_fmt = (config.quantization or {}).get("scale_fmt")
    if scale_fmt not in SCALE_FORMATS:
        raise CheckpointError(
            f"{source}: quantization_config.scale_fmt={scale_fmt!r} is not supported; "
            "use 'ue8m0' or none"
        )
    return dataclasses.replace(config, indexer=IndexerConfig.from_hf(raw, source))


__all__ = ["MODEL_TYPE", "DeepseekV3", "kv_layout", "load", "parse_config"]
