"""Rotary position embedding of DeepSeek-V3's decoupled RoPE dims, with the YaRN extension it ships.

DeepSeek-V3's ``config.json`` carries ``rope_scaling = {type: yarn, factor: 40, original_max_position_
embeddings: 4096, beta_fast: 32, beta_slow: 1, mscale: 1, mscale_all_dim: 1}``. YaRN blends each
frequency between its original value and the value divided by ``factor`` with a linear ramp over the
dims whose wavelength lies between ``beta_fast`` and ``beta_slow`` rotations of the original context,
scales cos/sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the attention
softmax by ``mscale(factor, mscale_all_dim)**2``. Formulas as in the YaRN paper (arXiv 2309.00071)
and Hugging Face ``transformers``' ``_compute_yarn_parameters``, which is the reference the tests use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeinfra.errors import InputError
from moeinfra.moe import cpu_kernels


@dataclass(frozen=True)
class Yarn:
    """YaRN context extension (the ``rope_scaling`` block of a DeepSeek ``config.json``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise InputError(f"rope_scaling.factor={self.factor} must be > 0")
        if self.original_max_position_embeddings < 1:
            raise InputError(
                "rope_scaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be >= 1"
            )

    @classmethod
    def from_hf(cls, rope_scaling: dict) -> Yarn:
        """From a ``rope_scaling`` / ``rope_parameters`` dict whose type is ``yarn``."""
        return cls(
            factor=float(rope_scaling["factor"]),
            original_max_position_embeddings=int(rope_scaling["original_max_position_embeddings"]),
            beta_fast=float(rope_scaling.get("beta_fast") or 32),
            beta_slow=float(rope_scaling.get("beta_slow") or 1),
            mscale=float(rope_scaling.get("mscale") or 0.0),
            mscale_all_dim=float(rope_scaling.get("mscale_all_dim") or 0.0),
        )


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(dim: int, theta: float, yarn: Yarn | None = None) -> torch.Tensor:
    """``[dim / 2]`` float32 angular frequency of each rotated pair (radians per position)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    base = theta**exponents
    inv_freq = 1.0 / base
    if yarn is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        wavelength_ratio = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelength_ratio) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty range
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: original frequency (extrapolate), 0: divided by factor (interpolate)
    return (1.0 / (yarn.factor * base)) * (1 - keep) + inv_freq * keep


def cos_sin_scale(yarn: Yarn | None) -> float:
    """Factor on cos/sin (YaRN's attention factor; 1 without YaRN)."""
    if yarn is None:
        return 1.0
    if yarn.mscale and yarn.mscale_all_dim:
        return _mscale(yarn.factor, yarn.mscale) / _mscale(yarn.factor, yarn.mscale_all_dim)
    return _mscale(yarn.factor)


def softmax_scale(qk_head_dim: int, yarn: Yarn | None) -> float:
    """Attention softmax scale: ``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2``."""
    scale = qk_head_dim**-0.5
    if yarn is not None and yarn.mscale_all_dim:
        scale *= _mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


class RotaryTable:
    """cos and sin (times ``scale``) of every rotated pair at positions ``0 .. n-1``, grown by
    doubling as larger positions come, so a step's layers gather rows instead of recomputing them.
    Row ``p`` equals what ``positions * inv_freq`` gives for ``p`` (the same float32 arithmetic).
    The rows of the last ``positions`` tensor asked for are kept: layers that share the table and
    the step's positions gather them once."""

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0) -> None:
        self.inv_freq, self.scale = inv_freq, scale
        self._reset()

    def _reset(self) -> None:
        self.cos = self.sin = self.inv_freq.new_zeros(0, self.inv_freq.numel())
        self._table = torch.complex(self.cos, self.sin)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions, cis rows)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, d/2]`` float32, of ``positions [T]``."""
        cis = self.cis(positions)
        return cis.real, cis.imag

    def cis(self, positions: torch.Tensor) -> torch.Tensor:
        """``cos + i sin``: ``[T, d/2]`` complex64 rows of ``positions [T]``."""
        if self._last is not None and self._last[0] is positions:
            return self._last[1]
        if positions.device != self.inv_freq.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            self._reset()
        if positions.numel():
            needed = int(positions.max()) + 1
            if needed > self.cos.shape[0]:
                size = max(needed, 2 * self.cos.shape[0], 256)
                angles = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device)
                angles = angles[:, None] * self.inv_freq[None, :]
                self.cos, self.sin = angles.cos() * self.scale, angles.sin() * self.scale
                self._table = torch.complex(self.cos, self.sin)
        rows = self._table[positions]
        self._last = (positions, rows)
        return rows


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True
) -> torch.Tensor:
    """Rotate ``x [T, ..., d]`` by per-token ``cos, sin [T, d/2]``.

    ``interleaved`` (DeepSeek's layout, ``rope_interleave``): pairs are ``(x[2i], x[2i+1])`` and the
    output keeps that layout; otherwise pairs are ``(x[i], x[i + d/2])`` (``rotate_half``).
    """
    d = x.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
    a, b = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


def rotate_cis(x: torch.Tensor, cis: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """:func:`rotate` with the rows of :meth:`RotaryTable.cis`: the interleaved layout as one
    complex product (three kernels instead of eight), in float32; on the CPU as moeinfra's kernel
    (``rope``: one operator, 3 vs 8.5 us for one token's 9 rotations of 32, 38 vs 109 us for
    2,048 tokens' in bfloat16; float32 results within an ulp)."""
    if not interleaved:
        return rotate(x, cis.real, cis.imag, interleaved=False)
    if cis.dtype == torch.complex64 and cpu_kernels.usable(x, cis):
        return torch.ops.moeinfra.rope(x, cis)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1] // 2,)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * cis.view(shape)).flatten(-2).to(x.dtype)
