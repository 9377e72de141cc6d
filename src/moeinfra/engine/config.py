"""A unit's engine options, importable without torch (so a command can check them first)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from moeinfra.errors import InputError

OVERLAPS = ("auto", "none", "prefill", "decode")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
FP8_WEIGHTS = ("auto", "keep", "dequantize")


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of a unit (the same on every rank).

    ``num_kv_blocks``: KV blocks per rank (``block_size`` tokens each). ``redundant_experts``:
    physical expert slots beyond one per expert, placed by EPLB. ``eplb_interval``: rebalance every
    this many steps from the expert loads of the last ``eplb_window`` steps (None: never).
    ``overlap``: dual micro-batch schedule of the MoE layers — ``auto`` (prefill schedule when the
    step has prompt tokens, decode pipeline otherwise; ``none`` on one rank), or fixed.
    ``device``: ``auto`` (a GPU when torch sees one), ``cpu``, ``cuda`` or ``cuda:N``; ``dtype``
    ``auto`` is bfloat16 on a GPU and float32 on the CPU (see :mod:`moeinfra.engine.device`).
    ``fp8_weights``: what happens to a checkpoint's FP8 projections — ``keep`` them in FP8
    (:class:`~moeinfra.engine.fp8.Fp8Linear`), ``dequantize`` them to ``dtype`` at load, or
    ``auto``: keep on a GPU with FP8 tensor cores (compute capability 8.9+), else dequantize.
    """

    block_size: int = 64
    num_kv_blocks: int = 512
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

    def __post_init__(self) -> None:
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
