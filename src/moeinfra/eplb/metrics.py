"""How good a plan is under a load: balance, its gap to a lower bound, duplicates and traffic.

Model (shared with DeepSeek's EPLB): an expert's tokens are split evenly over its replicas, so a slot
carries ``load[e] / logcnt[e]`` and a GPU the sum of its slots.

Lower bound on the maximum GPU load of any plan with ``R`` slots on ``G`` GPUs, per layer:

* ``sum(load) / G`` — the GPUs together carry the whole load;
* ``max_e load[e] / min(c_e, G)`` minimised over replica counts ``c`` (``sum c = R``): an expert
  with ``c_e`` replicas puts at least ``ceil(c_e / G)`` of them on one GPU, so that GPU carries at
  least ``load[e] * ceil(c_e / G) / c_e >= load[e] / min(c_e, G)``. The greedy replication of
  :func:`moeinfra.eplb.packing.replicate_spread` with cap ``G`` minimises that maximum exactly
  (each step lowers the current maximum; the result is the water-filling optimum).

The bound is the larger of the two; ``gap = max_gpu_load / bound - 1``.

Traffic model (tokens originate evenly on all nodes, as with data-parallel attention):

* ``remote_pair_fraction``: a token-expert pair stays on its node when the expert has a replica there
  (the dispatcher prefers a local replica); the fraction leaving is ``sum_e load[e] (1 - n_e / N) /
  sum(load)`` with ``n_e`` the number of nodes holding expert ``e``.
* ``nodes_per_token``: expected number of distinct nodes a token is sent to under group-limited
  routing (DeepEP sends a token once per destination node). A token picks ``groups_per_token`` groups,
  group ``g`` with probability ``pi_g = min(1, groups_per_token * load_g / load)``, and
  ``m = experts_per_token / groups_per_token`` experts inside each, expert ``e`` with probability
  ``load[e] / load_g``, served by one of its replicas chosen evenly. With ``a_gn`` the share of group
  ``g``'s load served on node ``n``, ``P(n reached) = 1 - prod_g (1 - pi_g (1 - (1 - a_gn)^m))`` and
  ``nodes_per_token = sum_n P(n reached)``. Selections are treated as independent (an approximation).
* ``gpus_per_token``: the same with GPUs in place of nodes — the distinct GPUs a token's rows land
  on, which is what crosses NVLink inside the destination nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moeinfra.eplb.inputs import Layout, to_numpy_load
from moeinfra.eplb.packing import replicate_spread
from moeinfra.eplb.plan import Plan, gpu_presence, replica_load
from moeinfra.errors import InputError


def lower_bound(
    load: np.ndarray, num_replicas: int, num_gpus: int, *, counts: np.ndarray | None = None
) -> np.ndarray:
    """``[L]`` lower bound on the maximum GPU load of any plan (derivation in the module docstring).

    ``counts`` may pass ``replicate_spread(load, num_replicas, num_gpus)`` if already computed.
    """
    if counts is None:
        counts = replicate_spread(load, num_replicas, num_gpus)
    per_expert = (load / np.minimum(counts, num_gpus)).max(axis=1)
    return np.maximum(load.sum(axis=1) / num_gpus, per_expert)


def _ratio(numerator: np.ndarray, denominator: np.ndarray, empty: float) -> np.ndarray:
    safe = np.where(denominator > 0, denominator, 1.0)
    return np.where(denominator > 0, numerator / safe, empty)


def fanout(served: np.ndarray, groups_per_token: int, experts_per_token: int) -> np.ndarray:
    """``[L]`` expected nodes per token from ``served [L, groups, nodes]``, the load of each group
    served on each node (see module doc)."""
    group_load = served.sum(axis=2)
    total = group_load.sum(axis=1, keepdims=True)
    pick_group = np.minimum(1.0, groups_per_token * _ratio(group_load, total, 0.0))
    share = _ratio(served, group_load[:, :, None], 0.0)
    per_group_reach = 1.0 - (1.0 - share) ** (experts_per_token / groups_per_token)
    miss = np.prod(1.0 - pick_group[:, :, None] * per_group_reach, axis=1)
    return (1.0 - miss).sum(axis=1)


def nodes_per_token(
    slot_load: np.ndarray,
    phy2log: np.ndarray,
    layout: Layout,
    groups_per_token: int,
    experts_per_token: int,
    *,
    per_gpu: bool = False,
) -> np.ndarray:
    """``[L]`` expected distinct destination nodes (``per_gpu``: GPUs) per token under
    group-limited routing (see module doc)."""
    num_layers, num_replicas = phy2log.shape
    places = layout.num_gpus if per_gpu else layout.num_nodes
    slot_place = np.arange(num_replicas) // (num_replicas // places)
    slot_group = phy2log // layout.experts_per_group
    cell = (np.arange(num_layers)[:, None] * layout.num_groups + slot_group) * places + slot_place
    served = np.bincount(
        cell.ravel(),
        weights=slot_load.ravel(),
        minlength=num_layers * layout.num_groups * places,
    ).reshape(num_layers, layout.num_groups, places)
    return fanout(served, groups_per_token, experts_per_token)


@dataclass(frozen=True)
class Evaluation:
    """Per-layer quality of a plan under a load (all arrays ``[L]`` unless stated).

    Attributes:
        gpu_load: ``[L, num_gpus]``. node_load: ``[L, num_nodes]``.
        max_gpu_load, mean_gpu_load: tokens (or whatever unit the load is in).
        balancedness: mean / max GPU load (1 = perfect), as vLLM and SGLang report it.
        max_over_mean: max / mean GPU load. lower_bound: see module doc. gap: max / bound - 1.
        duplicates: slots holding a second (third, ...) copy of an expert on the same GPU.
        remote_pair_fraction, nodes_per_token, gpus_per_token: traffic model, see module doc.
    """

    gpu_load: np.ndarray
    node_load: np.ndarray
    max_gpu_load: np.ndarray
    mean_gpu_load: np.ndarray
    balancedness: np.ndarray
    max_over_mean: np.ndarray
    lower_bound: np.ndarray
    gap: np.ndarray
    duplicates: np.ndarray
    remote_pair_fraction: np.ndarray
    nodes_per_token: np.ndarray
    gpus_per_token: np.ndarray

    def summary(self) -> dict[str, float]:
        """Whole-model figures: balancedness = sum of means / sum of maxima over layers, others averaged."""
        total_max = float(self.max_gpu_load.sum())
        return {
            "layers": int(self.max_gpu_load.size),
            "balancedness": float(self.mean_gpu_load.sum() / total_max) if total_max > 0 else 1.0,
            "max_over_mean": float(self.max_over_mean.mean()),
            "mean_gap_to_lower_bound": float(self.gap.mean()),
            "max_gap_to_lower_bound": float(self.gap.max()),
            "max_gpu_load_over_bound": float(
                self.max_gpu_load.sum() / max(self.lower_bound.sum(), 1e-300)
            ),
            "duplicates": int(self.duplicates.sum()),
            "remote_pair_fraction": float(self.remote_pair_fraction.mean()),
            "nodes_per_token": float(self.nodes_per_token.mean()),
            "gpus_per_token": float(self.gpus_per_token.mean()),
        }

    def to_dict(self) -> dict[str, Any]:
        """Summary plus per-layer lists (JSON-ready)."""
        per_layer = {
            name: getattr(self, name).tolist()
            for name in (
                "max_gpu_load",
                "mean_gpu_load",
                "balancedness",
                "max_over_mean",
                "lower_bound",
                "gap",
                "duplicates",
                "remote_pair_fraction",
                "nodes_per_token",
                "gpus_per_token",
            )
        }
        return {
            "summary": self.summary(),
            "per_layer": per_layer,
            "gpu_load": self.gpu_load.tolist(),
        }


def evaluate(
    plan: Plan, load: Any, *, groups_per_token: int | None = None, experts_per_token: int = 8
) -> Evaluation:
    """Evaluate ``plan`` under ``load [L, E]`` (numpy or torch).

    ``groups_per_token`` defaults to ``min(4, num_groups)`` (DeepSeek-V3 routes each token to at most
    4 of 8 groups); ``experts_per_token`` to 8.
    """
    lay = plan.layout
    array = to_numpy_load(load, "load")
    if array.shape != (plan.num_layers, lay.num_experts):
        raise InputError(
            f"load shape {array.shape} does not match the plan's [layers, experts] = "
            f"({plan.num_layers}, {lay.num_experts})"
        )
    groups_per_token = groups_per_token or min(4, lay.num_groups)
    if not 1 <= groups_per_token <= lay.num_groups:
        raise InputError(
            f"groups_per_token={groups_per_token} must be in 1..num_groups={lay.num_groups}"
        )
    slots = replica_load(array, plan.phy2log, plan.logcnt)
    gpu_load = slots.reshape(plan.num_layers, lay.num_gpus, -1).sum(axis=2)
    node_load = gpu_load.reshape(plan.num_layers, lay.num_nodes, -1).sum(axis=2)
    max_load = gpu_load.max(axis=1)
    mean_load = gpu_load.mean(axis=1)
    bound = lower_bound(array, lay.num_replicas, lay.num_gpus)
    presence = gpu_presence(plan.phy2log, lay.num_gpus, lay.num_experts)
    node_presence = presence.reshape(plan.num_layers, lay.num_nodes, lay.gpus_per_node, -1).sum(
        axis=2
    )
    nodes_holding = (node_presence > 0).sum(axis=1)
    remote = _ratio(
        (array * (1.0 - nodes_holding / lay.num_nodes)).sum(axis=1), array.sum(axis=1), 0.0
    )
    return Evaluation(
        gpu_load=gpu_load,
        node_load=node_load,
        max_gpu_load=max_load,
        mean_gpu_load=mean_load,
        balancedness=_ratio(mean_load, max_load, 1.0),
        max_over_mean=_ratio(max_load, mean_load, 1.0),
        lower_bound=bound,
        gap=_ratio(max_load, bound, 1.0) - 1.0,
        duplicates=np.maximum(presence - 1, 0).sum(axis=(1, 2)),
        remote_pair_fraction=remote,
        nodes_per_token=nodes_per_token(
            slots, plan.phy2log, lay, groups_per_token, experts_per_token
        ),
        gpus_per_token=nodes_per_token(
            slots, plan.phy2log, lay, groups_per_token, experts_per_token, per_gpu=True
        ),
    )
