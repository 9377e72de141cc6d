"""The kernels every architecture's terms are built of, each a roofline
``max(FLOPs / (peak * efficiency), bytes / (bandwidth * efficiency))``: FP8 GEMMs (at the plain
rate, or at DeepGEMM's published rate for the GEMM's role and rows), the MoE experts' GEMMs, BF16
attention, and an attention kernel sharing the SMs with an all-to-all."""

from __future__ import annotations

import numpy as np

from moeinfra.serving.perfmodel.efficiency import H800_FP8_TFLOPS, Efficiency
from moeinfra.serving.specs import HardwareSpec

_GROUPED = ("_contiguous", "_masked")


def _rows_table(role: str, tables: dict[str, dict[int, float]]) -> dict[int, float]:
    """TFLOPS by rows for ``role``; a grouped kernel's table is extended below its smallest
    published rows per expert by the plain GEMM of the same shape (DeepGEMM publishes the grouped
    kernels at 256+ rows per expert only)."""
    table = dict(tables[role])
    for suffix in _GROUPED:
        if role.endswith(suffix) and role.removesuffix(suffix) in tables:
            smallest = min(table)
            plain = tables[role.removesuffix(suffix)]
            table.update({m: v for m, v in plain.items() if m < smallest})
    return table


def gemm_tables(eff: Efficiency, hw: HardwareSpec) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per GEMM role: (log2 rows, achieved FLOP/s on ``hw``) from DeepGEMM's H800 table."""
    tables = {}
    for role in eff.gemm_tflops:
        table = _rows_table(role, eff.gemm_tflops)
        rows = sorted(table)
        tables[role] = (
            np.log2(np.array(rows, dtype=np.float64)),
            np.array([table[m] for m in rows]) / H800_FP8_TFLOPS * hw.fp8_tflops * 1e12,
        )
    return tables


class Roofline:
    """The kernel times of a unit's ``model`` on its ``hw`` at its ``eff`` (a base of
    :class:`~moeinfra.serving.perfmodel.step.PerfModel`, which sets them and ``_gemm_tables``,
    :func:`gemm_tables`)."""

    def _gemm(self, flops, weight_bytes, sm_fraction: float = 1.0):
        hw, eff = self.hw, self.eff
        return eff.gemm_time * np.maximum(
            flops / (hw.fp8_tflops * 1e12 * eff.gemm * sm_fraction),
            weight_bytes / (hw.hbm_tb_per_s * 1e12 * eff.memory),
        )

    def _deepgemm(self, role: str, rows, n: int, k: int, sm_fraction: float = 1.0, groups: int = 1):
        """Seconds of ``groups`` FP8 GEMMs ``[rows, k] x [k, n]`` at DeepGEMM's throughput for
        ``role`` at that many rows (log-interpolated, clamped; ``rows`` broadcasts)."""
        log_rows, peak = self._gemm_tables[role]
        rows = np.maximum(np.asarray(rows, dtype=np.float64), 2.0 ** log_rows[0])
        achieved = np.interp(np.log2(rows), log_rows, peak) * sm_fraction
        return self.eff.gemm_time * groups * 2.0 * rows * n * k / achieved

    def _experts(self, kind: str, tokens, experts: int, sm_fraction: float = 1.0):
        """Gate+up and down GEMMs of ``experts`` experts sharing ``tokens`` rows each; ``kind``:
        ``""`` (plain, the shared expert), ``"_contiguous"`` or ``"_masked"`` (grouped)."""
        m = self.model
        inter, hidden = m.moe_intermediate, m.hidden
        return self._deepgemm(
            "expert_up" + kind, tokens, 2 * inter, hidden, sm_fraction, experts
        ) + self._deepgemm("expert_down" + kind, tokens, hidden, inter, sm_fraction, experts)

    def _attention(
        self, factor: float, flops, kv_bytes, sm_fraction: float = 1.0, compute: float | None = None
    ):
        """BF16 attention roofline; ``compute``: the kernel's share of the BF16 peak (default
        ``attention_compute``, FlashMLA's dense kernels)."""
        hw, eff = self.hw, self.eff
        share = eff.attention_compute if compute is None else compute
        return factor * np.maximum(
            flops / (hw.bf16_tflops * 1e12 * share * sm_fraction),
            kv_bytes / (hw.hbm_tb_per_s * 1e12 * eff.memory),
        )

    @staticmethod
    def _beside_all_to_all(full_s, sm: float, comm_s):
        """Seconds of an attention kernel that takes ``full_s`` on every SM, started while an
        all-to-all holding the ``1 - sm`` share of the SMs has ``comm_s`` seconds left: it runs
        on the ``sm`` share until the all-to-all ends and on every SM after,
        ``min(full / sm, full + comm * (1 - sm))`` (all of it on the share when it ends first)."""
        if sm >= 1.0:
            return full_s
        return np.minimum(full_s / sm, full_s + np.maximum(comm_s, 0.0) * (1.0 - sm))
