"""Model architectures by ``config.json``'s ``model_type`` (as vLLM keeps them).

An :class:`Architecture` says how to read the config, what one token's KV cache holds, and how to
build one rank's model from a checkpoint. Built in: ``deepseek_v3``, ``deepseek_v32`` (sparse
attention with an indexer) and ``deepseek_v4`` (sliding-window and compressed attention, mHC); others
plug in with their own attention and :class:`~moeinfra.engine.kv_cache.KVLayout` through
:func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeinfra.engine.hf_config import ModelConfig
from moeinfra.engine.kv_cache import KVLayout
from moeinfra.errors import CheckpointError


@dataclass(frozen=True)
class Architecture:
    """``parse_config(raw, source) -> ModelConfig``; ``kv_layout(config, dtype, block_size) ->
    KVLayout``;
    ``load(reader, config, plan, comm, dtype, keep_fp8=False) -> model`` (see
    :mod:`.models.deepseek_v3`); ``load_mtp`` (same arguments, a one-layer plan) -> the draft model
    of speculative decoding (:mod:`.models.mtp`), None where the architecture has none;
    ``check_block_size(config, block_size)`` raises where the cache's blocks cannot be that size;
    ``resume_tokens(config, block_size)``: where the model keeps per-request state outside the
    cache, the positions (every this many tokens, whole blocks) it can rebuild it at — prefix hits
    and KV computed elsewhere are used up to such a position (None: any position);
    ``default_block_size(config)``: the block size ``LLM`` uses when none is given (None: the
    engine's default)."""

    model_type: str
    hf_architecture: str
    parse_config: Callable[[dict, str], ModelConfig]
    kv_layout: Callable[[ModelConfig, torch.dtype], KVLayout]
    load: Callable
    load_mtp: Callable | None = None
    check_block_size: Callable[[ModelConfig, int], None] | None = None
    resume_tokens: Callable[[ModelConfig, int], int] | None = None
    default_block_size: Callable[[ModelConfig], int] | None = None

    def block_size(self, config: ModelConfig) -> int:
        """The block size an engine of this model uses when none is given."""
        if self.default_block_size is None:
            from moeinfra.engine.config import EngineConfig

            return EngineConfig.block_size
        return self.default_block_size(config)


def default_block_size(model_dir) -> int:
    """The block size of the checkpoint in ``model_dir`` when none is given (64; for DeepSeek-V4
    the least multiple of 64 holding whole compression windows and four sliding windows)."""
    from moeinfra.engine.hf_config import read_config

    raw = read_config(model_dir)
    source = f"{model_dir}/config.json"
    arch = architecture(raw["model_type"], source)
    return arch.block_size(arch.parse_config(raw, source))


_REGISTRY: dict[str, Architecture] = {}


def register(architecture: Architecture) -> None:
    """Make ``architecture`` loadable by its ``model_type``."""
    _REGISTRY[architecture.model_type] = architecture


def _builtin() -> None:
    from moeinfra.engine.models import deepseek_v3, deepseek_v4, deepseek_v32, mtp

    for module, hf_architecture in (
        (deepseek_v3, "DeepseekV3ForCausalLM"),
        (deepseek_v32, "DeepseekV32ForCausalLM"),
    ):
        register(
            Architecture(
                module.MODEL_TYPE,
                hf_architecture,
                module.parse_config,
                module.kv_layout,
                module.load,
                mtp.load_mtp,
            )
        )
    v4 = deepseek_v4
    register(
        Architecture(
            v4.MODEL_TYPE,
            "DeepseekV4ForCausalLM",
            v4.parse_config,
            v4.kv_layout,
            v4.load,
            check_block_size=v4.check_block_size,
            resume_tokens=v4.checkpoint_tokens,
            default_block_size=v4.default_block_size,
        )
    )


def require_mtp(arch: Architecture, config: ModelConfig, source: str, option: str) -> None:
    """Raise a :class:`CheckpointError` naming ``source`` and the field when the checkpoint has no
    MTP layer to draft with (or its architecture no MTP support): ``option`` (the drafts asked
    for, as the caller names them) must then be 0."""
    if arch.load_mtp is None:
        raise CheckpointError(
            f"{source}: model_type={config.model_type!r} has no MTP draft support, so "
            f"{option} must be 0"
        )
    if config.num_mtp_layers < 1:
        raise CheckpointError(
            f"{source}: num_nextn_predict_layers={config.num_mtp_layers}: the checkpoint has no "
            f"MTP layer, so {option} must be 0"
        )


def architecture(model_type: str, source: str = "config.json") -> Architecture:
    """The registered architecture of ``model_type``; a :class:`CheckpointError` names the others."""
    if not _REGISTRY:
        _builtin()
    if model_type not in _REGISTRY:
        raise CheckpointError(
            f"{source}: model_type={model_type!r} is not supported; use one of {sorted(_REGISTRY)}"
        )
    return _REGISTRY[model_type]


def supported_model_types() -> list[str]:
    if not _REGISTRY:
        _builtin()
    return sorted(_REGISTRY)
