"""A unit's engine options, importable without torch (so a command can check them first)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeinfra.errors import InputError

OVERLAPS = ("auto", "none", "prefill", "decode")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
FP8_WEIGHTS = ("auto", "keep", "dequantize")

METHODS = ("mtp",)
# vLLM's DeepSeek MTP reuses the one MTP layer for every draft; past a few drafts acceptance is
# low (vLLM measures 24% for the 8th) and each draft costs a sequential MTP pass.
MAX_SPECULATIVE_TOKENS = 8
_EXAMPLE = '{"method": "mtp", "num_speculative_tokens": 1}'


def speculative_tokens(config: dict | None) -> int:
    """``num_speculative_tokens`` of vLLM's ``speculative_config`` dict (0 for None), checked:
    ``method`` must be ``"mtp"`` and the count in ``1 .. MAX_SPECULATIVE_TOKENS``."""
    if config is None:
        return 0
    if not isinstance(config, dict):
        raise InputError(f"speculative_config={config!r} must be a dict such as {_EXAMPLE}")
    method = config.get("method", "mtp")
    if method not in METHODS:
        raise InputError(
            f"speculative_config.method={method!r} is not supported; use one of {METHODS}"
        )
    unknown = sorted(set(config) - {"method", "num_speculative_tokens"})
    if unknown:
        raise InputError(
            f"speculative_config.{unknown[0]} is not supported; use method and "
            "num_speculative_tokens"
        )
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InputError(
            f"speculative_config.num_speculative_tokens={k!r} must be an integer in "
            f"1..{MAX_SPECULATIVE_TOKENS}"
        )
    return k


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of a unit (the same on every rank).

    ``num_kv_blocks``: KV blocks per rank (``block_size`` tokens each); None: sized from
    ``kv_cache_memory_bytes`` (one rank's cache) or else from ``memory_utilization`` of the
    device's memory (see :mod:`moeinfra.engine.kv_capacity`). ``redundant_experts``:
    physical expert slots beyond one per expert, placed by EPLB. ``eplb_interval``: rebalance every
    this many steps from the expert loads of the last ``eplb_window`` steps (None: never).
    ``overlap``: dual micro-batch schedule of the MoE layers — ``auto`` (prefill schedule when the
    step has prompt tokens, decode pipeline otherwise; ``none`` on one rank), or fixed.
    ``device``: ``auto`` (a GPU when torch sees one), ``cpu``, ``cuda`` or ``cuda:N``; ``dtype``
    ``auto`` is bfloat16 on a GPU and float32 on the CPU (see :mod:`moeinfra.engine.device`).
    ``fp8_weights``: what happens to a checkpoint's FP8 projections — ``keep`` them in FP8
    (:class:`~moeinfra.engine.fp8.Fp8Linear`), ``dequantize`` them to ``dtype`` at load, or
    ``auto``: keep on a GPU with FP8 tensor cores (compute capability 8.9+), else dequantize.
    ``num_speculative_tokens``: drafts per decode step from the checkpoint's MTP layer (0: none;
    ``LLM(speculative_config=...)`` sets it).
    """

    block_size: int = 64
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    dtype: str = "auto"
    redundant_experts: int = 0
    eplb_interval: int | None = None
    eplb_window: int = 64
    overlap: str = "auto"
    enable_prefix_caching: bool = True
    device: str = "auto"
    fp8_weights: str = "auto"
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InputError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1 (or None)")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise InputError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be >= 1 (or None)"
            )
        if not 0 < self.memory_utilization <= 1:
            raise InputError(f"memory_utilization={self.memory_utilization} must be in (0, 1]")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InputError(
                f"num_speculative_tokens={self.num_speculative_tokens} must be in "
                f"0..{MAX_SPECULATIVE_TOKENS} (0: no speculative decoding)"
            )
        if self.fp8_weights not in FP8_WEIGHTS:
            raise InputError(
                f"fp8_weights={self.fp8_weights!r} is not allowed; use one of "
                f"{', '.join(FP8_WEIGHTS)}"
            )
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device)):
            raise InputError(f"device={self.device!r} is not allowed; use {DEVICE_FORMS}")
        if self.dtype not in DTYPE_NAMES:
            raise InputError(
                f"dtype={self.dtype!r} is not allowed; use one of {', '.join(DTYPE_NAMES)}"
            )
        if self.overlap not in OVERLAPS:
            raise InputError(
                f"overlap={self.overlap!r} is not allowed; use one of {', '.join(OVERLAPS)}"
            )
        if self.redundant_experts < 0:
            raise InputError(f"redundant_experts={self.redundant_experts} must be >= 0")
        if self.eplb_interval is not None and self.eplb_interval < 1:
            raise InputError(f"eplb_interval={self.eplb_interval} must be >= 1 (or None)")
        if self.eplb_window < 1:
            raise InputError(f"eplb_window={self.eplb_window} must be >= 1")
