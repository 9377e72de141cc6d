"""Reference (single-process) MoE: SwiGLU experts, shared expert, RMSNorm."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moeinfra.moe import cpu_features, cpu_kernels
from moeinfra.moe.config import MoEConfig
from moeinfra.moe.gate import Gate

# Below this many multiply-adds torch's own GEMM call is cheaper than oneDNN's set-up (~15 us).
ONEDNN_MIN_MACS = 1 << 21
_ONEDNN = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight")
)
# the op's overload itself: ~2 us a call less than resolving it from the packet every time
_matmul = torch.ops.mkldnn._linear_pointwise.default if _ONEDNN else None
# The row count oneDNN lays a packed weight out for; measured fastest from 1 to 2,048 rows.
_PACKED_FOR_ROWS = 8


def _to_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight^T`` goes to oneDNN: CPU inference in bfloat16 (always, where the CPU
    has oneDNN's bfloat16 path: :mod:`~moeinfra.moe.cpu_features`), or in float32 from
    :data:`ONEDNN_MIN_MACS` on."""
    return (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and not torch.is_grad_enabled()
        and (
            (x.dtype == torch.bfloat16 and cpu_features.onednn_packs(torch.bfloat16))
            or (x.dtype == torch.float32 and x.numel() * weight.shape[0] >= ONEDNN_MIN_MACS)
        )
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T``: ``F.linear``, except for large float32 products on the
    CPU at inference, which go to oneDNN's matmul (torch's float32 CPU GEMM is MKL's, 2-2.5x
    slower than oneDNN on the AMD EPYC machines we measure on: 16.5 vs 7.7 ms for
    ``[8, 256] x [256, 129280]``, 1.8 vs 0.7 ms for ``[256, 256] x [256, 2048]``; 2 threads).
    Same result up to float32 rounding."""
    if x.dtype == torch.float32 and _to_onednn(x, weight):
        return _matmul(x, weight, None, "none", [], "")
    return F.linear(x, weight)


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose inference GEMM on the CPU is oneDNN's with the weight
    packed once in oneDNN's own layout (bfloat16 always, float32 where :func:`linear` takes
    oneDNN): the weight is then read as oneDNN's kernel wants it rather than reordered on every
    call — the LM head ``[8, 256] x [256, 129,280]`` 5.2 -> 3.6 ms in float32, 3.3 -> 1.9 ms in
    bfloat16 (2 threads, AMD EPYC). The packed copy is kept beside the weight (rebuilt when the
    weight changes); bfloat16 results are identical, float32 equal up to rounding."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self._packed: tuple[tuple, torch.Tensor] | None = None
        self._fused: tuple[tuple, torch.Tensor] | None = None  # see fused_linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _to_onednn(x, self.weight):
            return _matmul(x, self._packed_weight(), None, "none", [], "")
        return F.linear(x, self.weight)

    def __getstate__(self):
        # a copy or a pickle packs anew: oneDNN's packed tensor has no storage to copy
        return {**super().__getstate__(), "_packed": None, "_fused": None}

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = weight_key(w)
        if self._packed is None or self._packed[0] != key:
            packed = torch.ops.mkldnn._reorder_linear_weight(
                w.detach().contiguous(), _PACKED_FOR_ROWS
            )
            self._packed = (key, packed)
        return self._packed[1]


def fused_linears(x: torch.Tensor, *linears: Linear) -> tuple[torch.Tensor, ...]:
    """``linear(x)`` of each of ``linears`` (projections of the same input); on oneDNN's path
    one GEMM over their weights stacked and packed together, kept beside the first (rebuilt when
    any changes), in place of one call each: oneDNN costs ~12 us a call however small the GEMM
    (bfloat16, 2 threads), the time of a whole ``[1, 256] x [256, 128]`` product."""
    first = linears[0]
    if not all(isinstance(m, Linear) and _to_onednn(x, m.weight) for m in linears):
        return tuple(linear(x) for linear in linears)  # e.g. one of them kept in FP8
    key = tuple(weight_key(linear.weight) for linear in linears)
    fused = first._fused
    if fused is None or fused[0] != key:
        stacked = torch.cat([linear.weight.detach() for linear in linears])
        fused = (key, torch.ops.mkldnn._reorder_linear_weight(stacked, _PACKED_FOR_ROWS))
        first._fused = fused
    out = _matmul(x, fused[1], None, "none", [], "")
    return out.split([linear.out_features for linear in linears], dim=-1)


def weight_key(w: torch.Tensor) -> tuple:
    """What a copy derived from ``w`` is kept under: it changes when ``w`` is replaced, written
    to in place, cast or reshaped."""
    return (w.data_ptr(), w._version, w.dtype, tuple(w.shape))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dtype == w.dtype
            and (x.dtype == torch.float32 or x.numel() <= KERNEL_NORM_VALUES)
            and cpu_kernels.usable(x, w)
        ):
            return torch.ops.moeinfra.rms_norm(x, w, self.eps)
        return F.rms_norm(x, w.shape, w, self.eps)


# Half-precision values up to which RMSNorm runs as moeinfra's CPU kernel (float32: always):
# torch's ``F.rms_norm`` is 8 operators, ~10 us for one row of 256 against ~2 us; its vectorised
# half-precision conversions win on many rows (2,048 rows of 256 in bfloat16: 197 vs 346 us).
KERNEL_NORM_VALUES = 1 << 15


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit`` (DeepSeek-V4) gate clamped to ``<= limit`` and up to
    ``[-limit, limit]`` first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


class Expert(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``; ``[N, H] -> [N, H]`` (``limit``: see
    :func:`swiglu`)."""

    def __init__(self, hidden: int, intermediate: int, limit: float | None = None) -> None:
        super().__init__()
        self.w1 = Linear(hidden, intermediate)
        self.w2 = Linear(intermediate, hidden)
        self.w3 = Linear(hidden, intermediate)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(*fused_linears(x, self.w1, self.w3), self.limit))


def combine_pairs(pair_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over each token's routed copies.

    ``pair_outputs [T, k, H]`` expert outputs, ``weights [T, k]`` -> ``[T, H]``. One fixed
    reduction order, shared by the reference and the expert-parallel layer.
    """
    return torch.bmm(weights.unsqueeze(1).to(pair_outputs.dtype), pair_outputs).squeeze(1)


class MoE(nn.Module):
    """DeepSeek-V3 MoE: gate + ``E`` routed SwiGLU experts + shared expert(s), ``[T, H] -> [T, H]``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = Gate(config)
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, config.moe_intermediate_size)
            for _ in range(config.num_routed_experts)
        )
        self.shared = (
            Expert(config.hidden_size, config.num_shared_experts * config.moe_intermediate_size)
            if config.num_shared_experts
            else None
        )

    def routed(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Routed part for ``x [T, H]`` with routing ``weights, indices [T, k]``; ``[T, H]``."""
        num_tokens, top_k = indices.shape
        flat = indices.reshape(-1)
        outputs = x.new_zeros(num_tokens * top_k, x.shape[-1])
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.config.num_routed_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count:
                pairs = order[start : start + count]
                outputs[pairs] = self.experts[expert](x[pairs // top_k])
                start += count
        return combine_pairs(outputs.view(num_tokens, top_k, x.shape[-1]), weights)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x) if self.shared is not None else torch.zeros_like(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> routed + shared output ``[T, H]``."""
        weights, indices = self.gate(x)
        return self.routed(x, weights, indices) + self.shared_output(x)

    def expert_counts(self, x: torch.Tensor) -> torch.Tensor:
        """``[E]`` int64 routed copies per expert for ``x [T, H]``."""
        return torch.bincount(self.gate(x)[1].reshape(-1), minlength=self.config.num_routed_experts)


def build_moe(config: MoEConfig, seed: int = 0) -> MoE:
    """A reference MoE with weights drawn from ``seed`` (the same on every rank)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return MoE(config)
