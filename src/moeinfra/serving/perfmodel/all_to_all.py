"""The MoE all-to-all: DeepEP's dispatch and combine times, its normal kernels in prefill and its
low-latency kernels in decode (:mod:`moeinfra.serving.deepep` derives their rates)."""

from __future__ import annotations

import numpy as np

from moeinfra.serving import deepep
from moeinfra.serving.perfmodel.efficiency import Efficiency
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    Deployment,
    ExpertBalance,
    HardwareSpec,
)

DISPATCH_BYTES_PER_TOKEN = 7_392  # 7,168 FP8 values + 56 float32 scales, per destination
COMBINE_BYTES_PER_TOKEN = 14_336  # 7,168 BF16 values, per destination


def token_bytes(hidden: int) -> tuple[int, int]:
    """(dispatch, combine) bytes of one token row per destination for a model of ``hidden``
    dimensions: FP8 values with a float32 scale per 128, and BF16 values (V3's 7,168: 7,392 and
    14,336; V4-Flash's 4,096: 4,224 and 8,192)."""
    return hidden + 4 * (hidden // 128), 2 * hidden


def _interp_ep(table: dict[int, float], ep: int) -> float:
    """Value of a table keyed by EP degree at ``ep`` (log-linear between keys, clamped outside)."""
    keys = np.array(sorted(table), dtype=np.float64)
    values = np.array([table[int(k)] for k in keys])
    return float(np.interp(np.log2(ep), np.log2(keys), values))


def kernel_rates(
    dep: Deployment, hw: HardwareSpec, eff: Efficiency, balance: ExpertBalance, hidden: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(dispatch, combine) normal-kernel seconds per row across nodes, and (dispatch, combine)
    low-latency seconds for 128 tokens, of a unit ``dep`` of a model of ``hidden`` dimensions."""
    gpus = dep.gpus(hw)
    nic = hw.rdma_gb_per_s / 50.0  # the published kernel figures are for 50 GB/s NICs
    low_latency = eff.ll_latency_us_128
    normal_s_per_row = tuple(
        deepep.normal_seconds_per_row(
            dep.nodes,
            balance.nodes_per_token,
            balance.gpus_per_token,
            row_bytes,
            hw.rdma_gb_per_s,
            hw.nvlink_gb_per_s,
            eff.rdma_normal[i],
            eff.nvlink_normal[i],
        )
        if dep.nodes > 1
        else 0.0
        for i, row_bytes in enumerate(token_bytes(hidden))
    )
    # DeepEP's low-latency figures move V3's 7,168-dimension rows; another model's rows take
    # their bytes' share of that time (an assumption: the kernels are bandwidth-bound at 128
    # tokens; 1 for V3 and V3.2, 4,096/7,168 for V4-Flash)
    rows = hidden / DEEPSEEK_V3.hidden
    ll_128 = tuple(
        _interp_ep({k: v[i] for k, v in low_latency.items()}, gpus) * 1e-6 / nic * rows
        for i in (0, 1)
    )
    return normal_s_per_row, ll_128


class AllToAll:
    """A unit's all-to-all times (a base of :class:`~moeinfra.serving.perfmodel.step.PerfModel`,
    which sets what they read: ``dep``, ``hw``, ``eff``, ``model``, the expert ``balance``, the
    unit's ``gpus``, and ``_normal_s_per_row`` and ``_ll_128`` from :func:`kernel_rates`)."""

    def _a2a_normal(self, tokens):
        """Dispatch and combine seconds for ``tokens`` per GPU with DeepEP normal kernels."""
        m, dep = self.model, self.dep
        if dep.nodes == 1:
            bw = self.hw.nvlink_gb_per_s * 1e9 * self.eff.nvlink / self.eff.comm_time
            dests = min(m.experts_per_token, self.gpus) * (1 - 1 / self.gpus)
            return (
                tokens * DISPATCH_BYTES_PER_TOKEN * dests / bw + self.eff.comm_launch_s,
                tokens * COMBINE_BYTES_PER_TOKEN * dests / bw + self.eff.comm_launch_s,
            )
        rows = tokens * self.balance.imbalance * self.eff.comm_time
        return tuple(rows * self._normal_s_per_row[i] + self.eff.comm_launch_s for i in (0, 1))

    def _a2a_low_latency(self, tokens):
        """Dispatch and combine seconds for ``tokens`` per GPU with DeepEP low-latency kernels."""
        scale = tokens * self.balance.imbalance / 128.0
        fixed, f, wait = self.eff.ll_fixed_share, self.eff.comm_time, self.eff.ll_wait_s
        return tuple(
            f * self._ll_128[i] * (fixed[i] + (1.0 - fixed[i]) * scale) + wait for i in (0, 1)
        )

    def all_to_all_s(self, tokens_per_gpu: float) -> tuple[float, float]:
        """(dispatch, combine) seconds of one all-to-all call of ``tokens_per_gpu`` tokens per GPU:
        DeepEP's normal kernels in prefill, its low-latency kernels in decode."""
        if self.gpus == 1:
            return 0.0, 0.0
        kernel = self._a2a_normal if self.dep.phase == "prefill" else self._a2a_low_latency
        dispatch, combine = kernel(float(tokens_per_gpu))
        return float(dispatch), float(combine)
