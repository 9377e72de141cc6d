"""DeepSeek-V3's FP8 weight format: ``float8_e4m3fn`` weights with one float32 scale per 128x128 block.

A quantised linear weight ``W [out, in]`` is stored as ``weight`` (``float8_e4m3fn``) and
``weight_scale_inv [ceil(out / 128), ceil(in / 128)]`` (float32); the real weight is
``weight * weight_scale_inv`` block by block (DeepSeek's ``weight_dequant``).
"""

from __future__ import annotations

import torch

from moeinfra.errors import InputError

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _expand(scale: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    rows, cols = shape
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK, dtype=torch.float32
) -> torch.Tensor:
    """``weight [out, in]`` (fp8) times its block scales ``scale_inv [ceil(out/b), ceil(in/b)]``."""
    if weight.dim() != 2:
        raise InputError(f"weight must be 2-D, has shape {tuple(weight.shape)}")
    expected = (-(-weight.shape[0] // block), -(-weight.shape[1] // block))
    if tuple(scale_inv.shape) != expected:
        raise InputError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, weight {tuple(weight.shape)} "
            f"needs {expected} for {block}x{block} blocks"
        )
    return (weight.float() * _expand(scale_inv.float(), weight.shape, block)).to(dtype)


def quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise ``weight [out, in]`` as DeepSeek ships it: ``(fp8 weight, scale_inv)``."""
    w = weight.float()
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = w.new_zeros(nr * block, nc * block)
    padded[:rows, :cols] = w
    amax = padded.view(nr, block, nc, block).abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)
    q = (w / _expand(scale_inv, w.shape, block)).to(torch.float8_e4m3fn)
    return q, scale_inv
