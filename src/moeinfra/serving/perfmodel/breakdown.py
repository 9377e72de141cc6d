"""The parts a step is made of: their names, the per-layer :class:`LayerBreakdown` a step is
reported as, a decode micro-batch's :class:`DecodeParts`, and how a layer's parts overlap
(:func:`overlapped`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

PARTS = ("attn_proj", "core_attn", "shared", "routed", "gate", "dense_mlp", "dispatch", "combine")
#: The part a sparse-attention model adds (DeepSeek-V3.2's lightning indexer: its projections, the
#: FP8 logits of every query against every earlier index key, the top-k over them).
INDEXER = "indexer"


@dataclass(frozen=True)
class LayerBreakdown:
    """Per-layer seconds of one step, per part (``parts[name]`` is ``[layers]``: :data:`PARTS`, and
    :data:`INDEXER` for a sparse-attention model), and totals.

    ``compute`` / ``comm``: ``[layers]`` sums over both micro-batches; ``layer``: max of the two;
    ``step_s``: sum over layers plus ``head_s`` plus ``overhead_s`` (host and launch gaps).
    ``tokens``: tokens the unit processes in the step. ``sources``: where each MoE part's time
    comes from when measured kernels are in force (:mod:`moeinfra.serving.kernels`; empty: every
    part first-principles).
    """

    phase: str
    parts: dict[str, np.ndarray]
    compute: np.ndarray
    comm: np.ndarray
    layer: np.ndarray
    head_s: float
    overhead_s: float
    step_s: float
    tokens_per_gpu: float
    sources: dict[str, str] = field(default_factory=dict)

    def rows(self) -> list[dict[str, float]]:
        """One dict per layer (milliseconds) for tables and JSON."""
        out = []
        for i in range(self.layer.size):
            row = {"layer": i}
            row.update({name: float(v[i]) * 1e3 for name, v in self.parts.items()})
            row.update(
                compute_ms=float(self.compute[i]) * 1e3,
                comm_ms=float(self.comm[i]) * 1e3,
                layer_ms=float(self.layer[i]) * 1e3,
            )
            out.append(row)
        return out


class DecodeParts(NamedTuple):
    """Seconds of one decode micro-batch by part, each broadcasting over units: the eight
    :data:`PARTS` in their order, then the :data:`INDEXER` (None without one). DeepSeek-V4's
    ``core_attn`` and ``indexer`` are ``{layer kind: seconds}``."""

    attn_proj: Any
    core_attn: Any
    shared: Any
    routed: Any
    gate: Any
    dense_mlp: Any
    dispatch: Any
    combine: Any
    indexer: Any


def overlapped(mb: int, attention, mlp, dispatch, combine):
    """Seconds of one MoE layer with ``mb`` micro-batches (per-micro-batch inputs, broadcastable).

    With two micro-batches each all-to-all of one hides behind a compute segment of the other:
    its dispatch behind the other's expert MLPs (shared + routed), its combine behind the other's
    attention (projections, core attention, gate), so the layer costs
    ``2 * (max(mlp, dispatch) + max(attention, combine))`` — the max of the compute and
    communication paths plus what does not fit in its window. One micro-batch overlaps nothing.
    """
    if mb == 1:
        return attention + mlp + dispatch + combine
    return mb * (np.maximum(mlp, dispatch) + np.maximum(attention, combine))
