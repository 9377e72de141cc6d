"""What this CPU can run, asked once per process: every CPU fast path checks here and falls back.

moeinfra's measurements come from CPUs with AVX-512 and bfloat16 instructions; users' CPUs may have
neither. oneDNN's packed half-precision GEMM (:mod:`moeinfra.moe.layers`) refuses to run without
them ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"), so the
engine asks :func:`onednn_packs` first and otherwise calls torch's own GEMM, which runs bfloat16
on any x86 CPU (slower: float32 is then usually the faster choice, which the start-up line says).
Tests monkeypatch :func:`detect` to cover each fallback on a CPU that has everything.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class CpuFeatures:
    """``isa``: the vector width torch's own kernels dispatch to (``AVX512``, ``AVX2``, ...).
    ``onednn_bf16`` / ``onednn_fp16``: oneDNN runs (packs) half-precision GEMMs on this CPU
    (bfloat16: AVX-512 BW/VL/DQ or AVX-NE-CONVERT; float16: AVX512-FP16 or AVX-NE-CONVERT).
    ``avx512_bf16`` and ``amx``: the instructions that make bfloat16 faster than float32."""

    model: str
    isa: str
    avx512: bool
    avx512_bf16: bool
    amx: bool
    onednn_bf16: bool
    onednn_fp16: bool

    def onednn_packs(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN's packed GEMM takes ``dtype`` here (float32: wherever oneDNN is built)."""
        if dtype == torch.bfloat16:
            return self.onednn_bf16
        if dtype == torch.float16:
            return self.onednn_fp16
        return dtype == torch.float32

    def describe(self) -> str:
        """One line for logs and benchmark tables, e.g. ``AMD EPYC (AVX512; AVX-512 yes,
        bf16 instructions yes, AMX no; oneDNN bf16 yes)``."""

        def yes(flag: bool) -> str:
            return "yes" if flag else "no"

        return (
            f"{self.model} ({self.isa}; AVX-512 {yes(self.avx512)}, bf16 instructions "
            f"{yes(self.avx512_bf16 or self.amx)}, AMX {yes(self.amx)}; "
            f"oneDNN bf16 {yes(self.onednn_bf16)})"
        )


@functools.cache
def detect() -> CpuFeatures:
    """This machine's features (torch's own checks: cpuinfo, the same oneDNN asks)."""
    mkldnn = torch.backends.mkldnn.is_available()
    return CpuFeatures(
        model=_model_name(),
        isa=torch.backends.cpu.get_cpu_capability(),
        avx512=torch.cpu._is_avx512_supported(),
        avx512_bf16=torch.cpu._is_avx512_bf16_supported(),
        amx=torch.cpu._is_amx_tile_supported(),
        onednn_bf16=mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        onednn_fp16=mkldnn and torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    )


# A CPU with AVX2 only (AMD Zen 2/3, Intel before Skylake-SP): what tests force to cover fallbacks.
AVX2_ONLY = CpuFeatures(
    model="AVX2-only CPU",
    isa="AVX2",
    avx512=False,
    avx512_bf16=False,
    amx=False,
    onednn_bf16=False,
    onednn_fp16=False,
)


def onednn_packs(dtype: torch.dtype) -> bool:
    """``detect().onednn_packs(dtype)``."""
    return detect().onednn_packs(dtype)


def half_precision_note(dtype: torch.dtype) -> str | None:
    """A warning for running ``dtype`` on a CPU without its fast path (None when it has it)."""
    if dtype not in (torch.bfloat16, torch.float16) or onednn_packs(dtype):
        return None
    name = str(dtype).removeprefix("torch.")
    return (
        f"this CPU ({detect().describe()}) has no oneDNN {name} path; {name} GEMMs run as "
        "torch's own (correct, usually slower than float32)"
    )


def _model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
