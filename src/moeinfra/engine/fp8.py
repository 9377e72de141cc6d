"""DeepSeek's low-precision weight formats.

FP8 (DeepSeek-V3, V3.2, V4): a linear weight ``W [out, in]`` is stored as ``weight``
(``float8_e4m3fn``) and ``weight_scale_inv [ceil(out / 128), ceil(in / 128)]`` (float32, or
``float8_e8m0fnu`` powers of two with ``scale_fmt: ue8m0``); the real weight is
``weight * weight_scale_inv`` block by block (DeepSeek's ``weight_dequant``).

FP4 (DeepSeek-V4's routed experts, ``expert_dtype: fp4``, MXFP4): ``weight [out, in / 2]`` int8, two
E2M1 values per byte (low nibble first), and one power-of-two scale per 32 values of a row
(``[out, in / 32]``, ``float8_e8m0fnu``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moeinfra.errors import InputError

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_GROUP = 32  # values per MXFP4 scale
# the 16 E2M1 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


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


def quantize(
    weight: torch.Tensor, block: int = BLOCK, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise ``weight [out, in]`` as DeepSeek ships it: ``(fp8 weight, scale_inv)``;
    ``power_of_two``: each scale rounded up to a power of two (``scale_fmt: ue8m0``)."""
    w = weight.float()
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = w.new_zeros(nr * block, nc * block)
    padded[:rows, :cols] = w
    amax = padded.view(nr, block, nc, block).abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)
    if power_of_two:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (w / _expand(scale_inv, w.shape, block)).to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``packed [out, in / 2]`` (int8 or uint8, two E2M1 codes per byte, low nibble first) times
    ``scale [out, in / 32]`` -> ``[out, in]``."""
    if packed.dim() != 2:
        raise InputError(f"FP4 weight must be 2-D, has shape {tuple(packed.shape)}")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if tuple(scale.shape) != (rows, cols // FP4_GROUP) or cols % FP4_GROUP:
        raise InputError(
            f"FP4 scale has shape {tuple(scale.shape)}, weight {(rows, cols)} needs "
            f"{(rows, cols // FP4_GROUP)} (one per {FP4_GROUP} values)"
        )
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(FP4_VALUES, device=packed.device)
    values = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], dim=-1)
    values = values.reshape(rows, cols // FP4_GROUP, FP4_GROUP) * scale.float()[..., None]
    return values.reshape(rows, cols).to(dtype)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of ``weight [out, in]``: ``(int8 [out, in / 2], float8_e8m0fnu [out, in / 32])``,
    each group's scale the power of two that fits its largest value under 6, values rounded to
    the nearest E2M1 code."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    table = torch.tensor(FP4_VALUES)
    codes = (groups / scale).unsqueeze(-1).sub(table).abs().argmin(dim=-1).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.squeeze(-1).to(torch.float8_e8m0fnu)


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays in DeepSeek's FP8 format: ``weight [out, in]``
    (``float8_e4m3fn``) and ``weight_scale_inv [ceil(out/128), ceil(in/128)]`` (float32).

    ``forward(x [..., in]) -> [..., out]`` in ``x``'s dtype. On a GPU whose ``torch._scaled_mm``
    takes DeepSeek's block scales (CUDA 12.9+ on sm90: activations quantised per token and
    128-wide group, as DeepSeek's ``act_quant``), the product runs in FP8 on the tensor cores. The
    first product of every weight shape on a device is checked against the dequantised product
    (relative error below :data:`AGREEMENT`); a shape that fails, or raises, is dequantised from
    then on. Elsewhere (the CPU, other GPUs, shapes not in 128-multiples) the weight is dequantised
    for the call: the same numbers as a checkpoint dequantised at load, half the memory held.
    """

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        super().__init__()
        expected = (-(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK))
        if tuple(scale_inv.shape) != expected:
            raise InputError(
                f"weight_scale_inv has shape {tuple(scale_inv.shape)}, weight "
                f"{tuple(weight.shape)} needs {expected} for {BLOCK}x{BLOCK} blocks"
            )
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv.float(), requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if _scaled_mm_usable(self, flat):
            out = _scaled_mm_checked(self, flat)
            if out is not None:
                return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype))


# (device, in_features, out_features) -> whether torch._scaled_mm with DeepSeek's block scales
# agreed with the dequantised product there; why not, where it raised
_SCALED_MM_OK: dict[tuple[torch.device, int, int], bool] = {}
_SCALED_MM_ERRORS: dict[tuple[torch.device, int, int], str] = {}
ROW_ALIGN = 16
# cuBLAS reads 128x128 scales K-major in rows of a multiple of 4 blocks; torch._scaled_mm (2.11)
# refuses scales padded to that, so only weights with in_features a multiple of 512 qualify
# (measured on an H200: 256 and 768 raise "Invalid scaling configuration")
SCALE_ALIGN = 4
# relative error (Frobenius) allowed between the FP8 product and the dequantised one: the FP8
# product also rounds the activations to 3 mantissa bits (~2-4% relative)
AGREEMENT = 0.08


def _scaled_mm_usable(layer: Fp8Linear, x: torch.Tensor) -> bool:
    return (
        x.device.type == "cuda"
        and x.dtype in (torch.bfloat16, torch.float32)
        and _SCALED_MM_OK.get((x.device, layer.in_features, layer.out_features), True)
        and hasattr(torch, "_scaled_mm")
        and layer.in_features % (BLOCK * SCALE_ALIGN) == 0
        and layer.out_features % BLOCK == 0
        and x.shape[0] > 0
    )


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's ``act_quant``: ``x [M, K]`` in 1x128 groups -> ``(fp8 [M, K], scale [M, K/128])``
    with ``x ~= fp8 * scale`` per group."""
    m, k = x.shape
    groups = x.float().reshape(m, k // BLOCK, BLOCK)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (groups / scale[..., None]).view(m, k).to(torch.float8_e4m3fn), scale


def scaled_mm_blockwise(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor):
    """``x [M, K] @ dequant(weight)^T`` in FP8 by ``torch._scaled_mm`` with 1x128 activation and
    128x128 weight scales (cuBLAS wants the 1x128 scales outer-dim-major, the 128x128 ones K-major;
    ``K`` a multiple of 512, see :data:`SCALE_ALIGN`)."""
    rows = x.shape[0]
    padded = -(-rows // ROW_ALIGN) * ROW_ALIGN  # aligned row counts: pad with zeros
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    x_fp8, x_scale = quantize_activations(x)
    x_scale = x_scale.t().contiguous().t()
    out_dtype = x.dtype if x.dtype == torch.bfloat16 else torch.float32
    out = torch._scaled_mm(
        x_fp8, weight.t(), scale_a=x_scale, scale_b=scale_inv.t(), out_dtype=out_dtype
    )
    return out[:rows].to(x.dtype)


def _scaled_mm_checked(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor | None:
    key = (x.device, layer.in_features, layer.out_features)
    try:
        out = scaled_mm_blockwise(x, layer.weight, layer.weight_scale_inv)
    except (RuntimeError, ValueError, TypeError) as err:
        if key not in _SCALED_MM_OK:  # never worked for this shape: do not try again
            _SCALED_MM_OK[key] = False
            _SCALED_MM_ERRORS[key] = f"{type(err).__name__}: {err}"[:300]
        return None
    if key not in _SCALED_MM_OK:
        reference = F.linear(x.float(), layer.dequantized(torch.float32))
        error = (out.float() - reference).norm() / reference.norm().clamp(min=1e-30)
        _SCALED_MM_OK[key] = bool(error < AGREEMENT)
        if not _SCALED_MM_OK[key]:
            _SCALED_MM_ERRORS[key] = f"relative error {float(error):.3g}"
            return None
    return out


def fp8_kernel(device: torch.device) -> str:
    """Which FP8 product ran on ``device``: ``scaled_mm`` (tensor cores, every weight shape),
    ``dequantize`` (the weight dequantised per call; why, per shape) or both, or ``untried``."""
    shapes = {k: ok for k, ok in _SCALED_MM_OK.items() if k[0] == device}
    if not shapes:
        return "untried" if device.type == "cuda" else "dequantize"
    bad = [f"{k[1]}x{k[2]}: {_SCALED_MM_ERRORS.get(k, '')}" for k, ok in shapes.items() if not ok]
    good = len(shapes) - len(bad)
    if not bad:
        return f"scaled_mm ({good} weight shapes)"
    head = f"scaled_mm ({good} weight shapes), " if good else ""
    return head + f"dequantize ({'; '.join(bad)})"
