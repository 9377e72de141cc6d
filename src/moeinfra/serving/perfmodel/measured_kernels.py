"""Measured kernel tables in the step (:mod:`moeinfra.serving.kernels`): where they cover a unit,
their routed-expert, dispatch and combine times replace the first-principles ones."""

from __future__ import annotations

from functools import cached_property

import numpy as np


class MeasuredKernels:
    """A unit's lookups in its measured kernel tables, ``kernels`` (None: none; a base of
    :class:`~moeinfra.serving.perfmodel.step.PerfModel`, which sets them and the ``dep``,
    ``model``, expert ``balance`` and ``gpus`` they read)."""

    def _measured(self, tokens: float, sm_fraction: float, routed, dispatch, combine):
        """The routed experts, dispatch and combine of a micro-batch of ``tokens`` per GPU from
        the measured kernel tables where they cover this unit (``self.kernels``), and each part's
        source; unchanged (and no sources) without tables."""
        if self.kernels is None:
            return routed, dispatch, combine, {}
        times = self.kernels.moe_parts(
            self.dep.phase,
            self.dep.nodes,
            self.gpus,
            self._moe_shape,
            heaviest_tokens=tokens * self.balance.imbalance,
            sm_fraction=sm_fraction,
            first_principles={"routed": routed, "dispatch": dispatch, "combine": combine},
        )
        sources = {name: t.label for name, t in times.items()}
        return times["routed"].seconds, times["dispatch"].seconds, times["combine"].seconds, sources

    def _measured_many(self, tokens, routed, dispatch, combine):
        """:meth:`_measured` over arrays of micro-batch ``tokens`` per GPU (decode steps of many
        units at once), seconds only."""
        curve, a2a = self._kernel_curves
        heaviest = np.asarray(tokens, dtype=np.float64) * self.balance.imbalance
        if curve is not None:
            routed = curve.seconds_at(heaviest, routed)
        if a2a is not None:
            dispatch, combine = (
                c.seconds_at(heaviest, t) for c, t in zip(a2a, (dispatch, combine), strict=True)
            )
        return routed, dispatch, combine

    @property
    def _moe_shape(self) -> dict[str, int]:
        """The MoE dimensions the measured tables are keyed by."""
        m = self.model
        return {
            "hidden": m.hidden,
            "topk": m.experts_per_token,
            "experts": m.num_routed_experts,
            "inter": m.moe_intermediate,
        }

    @cached_property
    def _kernel_curves(self):
        return self.kernels.moe_curves(self.dep.phase, self.dep.nodes, self.gpus, self._moe_shape)

    def kernel_coverage(self) -> dict[str, str] | None:
        """Per MoE part, which measured kernel table applies and over which tokens per GPU
        (outside them, and for every other part, the first-principles time); None without
        tables."""
        if self.kernels is None:
            return None
        curve, a2a = self._kernel_curves
        none = f"first-principles (no measured table for this {self.dep.nodes}-node unit)"
        out = {"routed": none if curve is None else curve.covers()}
        for i, part in enumerate(("dispatch", "combine")):
            out[part] = none if a2a is None else a2a[i].covers()
        return out
