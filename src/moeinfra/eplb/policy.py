"""``rebalance``: moeinfra's EPLB policies, never worse than DeepSeek's on any layer.

Policies:

* ``"deepseek"`` — DeepSeek's published policy (:mod:`moeinfra.eplb.deepseek`).
* ``"global"`` — replicate over all GPUs (counts capped at ``num_gpus`` so no GPU holds an expert
  twice; ties spread over experts), pack replicas heaviest first, each onto the lightest GPU with a free
  slot that does not hold its expert yet, then swap slots between GPUs to lower the heaviest one (:mod:`moeinfra.eplb.local_search`).
* ``"hierarchical"`` — DeepSeek's group-to-node packing (each expert group stays on one node, so a
  token reaches at most ``groups_per_token`` nodes), then the same replicate / pack / swap steps
  inside each node. Needs ``num_groups % num_nodes == 0``.
* ``"auto"`` — per layer, the candidate (hierarchical or global) with the lowest estimated MoE-layer
  time. With dual micro-batch overlap a layer takes about the longer of its compute path and its
  communication path. In units of the compute time of a perfectly balanced layer:
  ``cost = max(max_over_mean, traffic_weight * nodes_per_token / min_nodes_per_token)``, where
  ``nodes_per_token`` is the expected node fan-out of a token under group-limited routing
  (:mod:`moeinfra.eplb.metrics`) and the minimum is over the candidates. ``traffic_weight`` is the
  communication/compute time ratio of the least-traffic plan. Default 0.85, from DeepSeek-V3 prefill
  on H800 (REFERENCE.md figures): per token and MoE layer ~1.33 GFLOP (8 routed + 1 shared expert
  793 MFLOP, MLA projections 374 MFLOP, core attention over a 4K prompt ~168 MFLOP) is ~1.0 us at
  ~1350 TFLOPS, while RDMA carries 7,392 B dispatch + 14,336 B combine to ~2.3 remote nodes per
  token, ~50 KB at ~58 GB/s (DeepEP EP32) = ~0.87 us. A candidate only qualifies if its heaviest GPU
  is not above DeepSeek's policy on that layer; with one node there is nothing to trade and the
  hierarchical candidate (one node = all GPUs) is used.

Forced ``global``/``hierarchical`` candidates are compared, layer by layer, with DeepSeek's plan of the
same kind improved by the same swaps; the better one is kept. ``auto`` qualifies candidates against
DeepSeek's own choice (``rebalance_experts``). So no layer is ever worse than DeepSeek's. Swap search on
a layer stops once its heaviest GPU is within ``tolerance`` of the lower bound.

Migration-aware mode (``previous`` given): start from the previous placement, apply only swaps (and
replica reassignments where the load now calls for other replica counts) that lower the heaviest
GPU by more than ``min_gain`` of its load, at most ``max_moves`` changed slots in total (counted
against ``previous``), the largest relative gains first (docs/eplb.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from moeinfra.eplb.deepseek import (
    deepseek_arrays,
    group_nodes,
    rebalance_hierarchical,
    replicate_experts,
)
from moeinfra.eplb.inputs import Layout, check_layout, to_numpy_load
from moeinfra.eplb.local_search import (
    duplicate_slots,
    improve_by_swaps,
    reassign_duplicates,
    repair_duplicates,
    shift_replicas,
)
from moeinfra.eplb.metrics import fanout, lower_bound, nodes_per_token
from moeinfra.eplb.packing import expand_counts, pack_lightest_first, replicate_spread
from moeinfra.eplb.plan import Plan, count_replicas, gpu_loads, make_plan, replica_load
from moeinfra.errors import InputError

POLICIES = ("auto", "hierarchical", "global", "deepseek")
DEFAULT_TRAFFIC_WEIGHT = 0.85


def _slot_loads(load: np.ndarray, phy2log: np.ndarray, lay: Layout) -> np.ndarray:
    return replica_load(load, phy2log, count_replicas(phy2log, lay.num_experts))


def _max_gpu_load(load: np.ndarray, phy2log: np.ndarray, lay: Layout) -> np.ndarray:
    """``[L]`` heaviest GPU of each layer of ``phy2log`` under ``load``."""
    counts = count_replicas(phy2log, lay.num_experts)
    return gpu_loads(load, phy2log, counts, lay.num_gpus).max(axis=1)


def _expert_node(phy2log: np.ndarray, lay: Layout) -> np.ndarray:
    """``[L, E]`` node of each expert in a plan where all replicas of an expert share a node."""
    per_node = lay.num_replicas // lay.num_nodes
    node_of_slot = np.broadcast_to(np.arange(lay.num_replicas) // per_node, phy2log.shape)
    expert_node = np.empty((phy2log.shape[0], lay.num_experts), dtype=np.int64)
    np.put_along_axis(expert_node, phy2log, node_of_slot, axis=1)
    return expert_node


def _pack_global(load: np.ndarray, counts: np.ndarray, lay: Layout) -> np.ndarray:
    """Replicas (``counts [L, E]``) packed heaviest first onto the lightest GPUs; ``[L, R]``."""
    slot_expert = expand_counts(counts)
    slot_load = np.take_along_axis(load / counts, slot_expert, axis=1)
    bins = pack_lightest_first(slot_load, lay.num_gpus, slot_expert)
    return np.take_along_axis(slot_expert, bins.reshape(load.shape[0], -1), axis=1)


def _pack_hierarchical(load: np.ndarray, ds_phy2log: np.ndarray, lay: Layout) -> np.ndarray:
    """Keep the node DeepSeek's plan gives each expert; replicate and pack inside each node; ``[L, R]``."""
    num_layers = load.shape[0]
    per_node = lay.num_replicas // lay.num_nodes
    experts_per_node = lay.num_experts // lay.num_nodes
    node_experts = np.argsort(_expert_node(ds_phy2log, lay), axis=1, kind="stable")
    rows = num_layers * lay.num_nodes
    node_load = np.take_along_axis(load, node_experts, axis=1).reshape(rows, experts_per_node)
    counts = replicate_spread(node_load, per_node, lay.gpus_per_node)
    local_expert = expand_counts(counts)
    slot_load = np.take_along_axis(node_load / counts, local_expert, axis=1)
    bins = pack_lightest_first(slot_load, lay.gpus_per_node, local_expert).reshape(rows, per_node)
    local_slots = np.take_along_axis(local_expert, bins, axis=1)
    placed = np.take_along_axis(node_experts.reshape(rows, experts_per_node), local_slots, axis=1)
    return placed.reshape(num_layers, lay.num_replicas)


def _spare_counts(load: np.ndarray, num_replicas: int) -> np.ndarray:
    """``[L, E]`` replica counts that spend the redundant slots on the lightest experts.

    The heavy-first counts of ``replicate_spread`` are usually best, but when GPUs are few the
    split halves of a heavy expert can pack worse than the whole expert: this is the other extreme.
    """
    num_experts = load.shape[1]
    extra = num_replicas - num_experts
    rank = np.argsort(np.argsort(load, axis=1, kind="stable"), axis=1, kind="stable")
    return 1 + extra // num_experts + (rank < extra % num_experts)


def _swap_search(
    phy2log: np.ndarray, load: np.ndarray, lay: Layout, domain: int, target: np.ndarray
) -> np.ndarray:
    """Duplicate repair then swap search (until ``target [L]`` is reached) on a copy of ``phy2log``."""
    phy2log = phy2log.copy()
    slot_load = _slot_loads(load, phy2log, lay)
    repair_duplicates(phy2log, slot_load, lay.num_gpus, domain)
    improve_by_swaps(phy2log, slot_load, lay.num_gpus, gpus_per_domain=domain, target=target)
    return phy2log


def _never_worse(
    ours: np.ndarray,
    reference: Callable[[np.ndarray], np.ndarray],
    bound: np.ndarray,
    load: np.ndarray,
    lay: Layout,
    domain: int,
    target: np.ndarray,
) -> np.ndarray:
    """Per layer, ``ours`` unless DeepSeek's plan (swap-improved, else raw) is lighter.

    ``reference(rows)`` builds DeepSeek's plan for those layers; ``bound [L]`` is a lower bound on
    its heaviest GPU, so only layers where ours is above the bound need DeepSeek's plan at all.
    Where DeepSeek's plan is lighter, our (duplicate-free) plan is first searched further, down to
    DeepSeek's heaviest GPU; only layers where that fails take DeepSeek's plan, swap-improved.
    """
    ours_max = _max_gpu_load(load, ours, lay)
    unsure = np.flatnonzero(ours_max > bound)
    if unsure.size == 0:
        return ours
    ref = reference(unsure)
    ref_max = _max_gpu_load(load[unsure], ref, lay)
    worse = np.flatnonzero(ours_max[unsure] > ref_max)
    if worse.size == 0:
        return ours
    rows = unsure[worse]
    result = ours.copy()
    result[rows] = _swap_search(ours[rows], load[rows], lay, domain, ref_max[worse])
    still = _max_gpu_load(load[rows], result[rows], lay) > ref_max[worse]
    if still.any():
        rows, worse = rows[still], worse[still]
        refined = _swap_search(ref[worse], load[rows], lay, domain, target[rows])
        keep_refined = _max_gpu_load(load[rows], refined, lay) <= ref_max[worse]
        result[rows] = np.where(keep_refined[:, None], refined, ref[worse])
        reassign_duplicates(result, load, lay.num_gpus, domain)
    return result


def _deepseek_rows(
    load: np.ndarray, lay: Layout, hierarchical: bool
) -> Callable[[np.ndarray], np.ndarray]:
    """``rows -> phy2log`` of DeepSeek's hierarchical (or global) policy for those layers only."""
    groups, nodes = (lay.num_groups, lay.num_nodes) if hierarchical else (1, 1)

    def build(rows: np.ndarray) -> np.ndarray:
        weight = load[rows].astype(np.float32)
        return rebalance_hierarchical(weight, lay.num_replicas, groups, nodes, lay.num_gpus)[0]

    return build


def _deepseek_global_bound(load: np.ndarray, lay: Layout) -> np.ndarray:
    """``[L]`` lower bound on the heaviest GPU of DeepSeek's global plan, from its replica counts.

    The mean GPU load and the largest load per replica; with two slots per GPU, the best pairing of
    those replicas (largest with smallest), which is optimal for two items per bin.
    """
    _, _, counts = replicate_experts(load.astype(np.float32), lay.num_replicas)
    per_replica = load / counts
    bound = np.maximum(load.sum(axis=1) / lay.num_gpus, per_replica.max(axis=1))
    if lay.slots_per_gpu == 2:
        items = np.sort(np.take_along_axis(per_replica, expand_counts(counts), axis=1), axis=1)
        pairs = items[:, : lay.num_gpus] + items[:, ::-1][:, : lay.num_gpus]
        bound = np.maximum(bound, pairs.max(axis=1))
    return bound


def _hierarchical(
    load: np.ndarray, lay: Layout, ds_hier: np.ndarray, target: np.ndarray
) -> np.ndarray:
    domain = lay.gpus_per_node
    ours = _swap_search(_pack_hierarchical(load, ds_hier, lay), load, lay, domain, target)
    return _never_worse(
        ours, lambda rows: ds_hier[rows], np.zeros(load.shape[0]), load, lay, domain, target
    )


def _global(load: np.ndarray, lay: Layout, counts: np.ndarray, target: np.ndarray) -> np.ndarray:
    ours = _swap_search(_pack_global(load, counts, lay), load, lay, lay.num_gpus, target)
    bound = _deepseek_global_bound(load, lay)
    return _never_worse(
        ours, _deepseek_rows(load, lay, False), bound, load, lay, lay.num_gpus, target
    )


def _auto(
    load: np.ndarray,
    lay: Layout,
    counts: np.ndarray,
    target: np.ndarray,
    traffic_weight: float,
    groups_per_token: int,
    experts_per_token: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, global or hierarchical by the cost in the module doc; returns ``(phy2log, is_global)``.

    DeepSeek's hierarchical plan keeps each group on the node its first step gives it, so its node
    fan-out follows from that step alone, and its heaviest GPU is at least its heaviest node over the
    GPUs per node. The full plan (and the hierarchical candidate) is built only for layers where those
    bounds do not already settle the choice.
    """
    num_layers = load.shape[0]
    mean = np.maximum(load.sum(axis=1) / lay.num_gpus, 1e-300)
    glob = _swap_search(_pack_global(load, counts, lay), load, lay, lay.num_gpus, target)
    glob_slots = _slot_loads(load, glob, lay)
    glob_max = glob_slots.reshape(num_layers, lay.num_gpus, -1).sum(axis=2).max(axis=1)
    glob_fanout = nodes_per_token(glob_slots, glob, lay, groups_per_token, experts_per_token)

    expert_node = group_nodes(load.astype(np.float32), lay.num_groups, lay.num_nodes)
    cell = (np.arange(num_layers)[:, None] * lay.num_nodes + expert_node).ravel()
    node_load = np.bincount(cell, weights=load.ravel(), minlength=num_layers * lay.num_nodes)
    node_max = node_load.reshape(num_layers, lay.num_nodes).max(axis=1)
    group_node = expert_node[:, :: lay.experts_per_group]
    group_load = load.reshape(num_layers, lay.num_groups, -1).sum(axis=2)
    served = np.zeros((num_layers, lay.num_groups, lay.num_nodes))
    np.put_along_axis(served, group_node[:, :, None], group_load[:, :, None], axis=2)
    hier_fanout = fanout(served, groups_per_token, experts_per_token)
    least = np.maximum(np.minimum(glob_fanout, hier_fanout), 1e-12)

    ds_floor = node_max / lay.gpus_per_node
    glob_cost = np.maximum(glob_max / mean, traffic_weight * glob_fanout / least)
    hier_cost_floor = np.maximum(ds_floor / mean, traffic_weight * hier_fanout / least)
    open_rows = np.flatnonzero((glob_max > ds_floor) | (hier_cost_floor < glob_cost))
    is_global = np.ones(num_layers, dtype=bool)
    result = glob.copy()
    if open_rows.size == 0:
        return result, is_global
    ds_hier = _deepseek_rows(load, lay, True)(open_rows)
    sub_load = load[open_rows]
    ds_hier_max = _max_gpu_load(sub_load, ds_hier, lay)
    heavier = np.flatnonzero(glob_max[open_rows] > ds_hier_max)
    if heavier.size and lay.num_replicas > lay.num_experts:
        rows = open_rows[heavier]
        spare = _spare_counts(load[rows], lay.num_replicas)
        alt = _swap_search(
            _pack_global(load[rows], spare, lay), load[rows], lay, lay.num_gpus, target[rows]
        )
        alt_slots = _slot_loads(load[rows], alt, lay)
        alt_max = alt_slots.reshape(rows.size, lay.num_gpus, -1).sum(axis=2).max(axis=1)
        better = (alt_max < glob_max[rows]) & ~duplicate_slots(alt, lay.num_gpus).any(axis=1)
        rows, alt, alt_slots = rows[better], alt[better], alt_slots[better]
        result[rows] = alt
        glob_max[rows] = alt_max[better]
        glob_fanout[rows] = nodes_per_token(
            alt_slots, alt, lay, groups_per_token, experts_per_token
        )
        least[rows] = np.maximum(np.minimum(glob_fanout[rows], hier_fanout[rows]), 1e-12)
        glob_cost[rows] = np.maximum(
            glob_max[rows] / mean[rows], traffic_weight * glob_fanout[rows] / least[rows]
        )
    glob_ok = glob_max[open_rows] <= ds_hier_max
    hier = _hierarchical(sub_load, lay, ds_hier, target[open_rows])
    hier_cost = np.maximum(
        _max_gpu_load(sub_load, hier, lay) / mean[open_rows],
        traffic_weight * hier_fanout[open_rows] / least[open_rows],
    )
    take = ~glob_ok | (hier_cost < glob_cost[open_rows])
    result[open_rows[take]] = hier[take]
    is_global[open_rows[take]] = False
    return result, is_global


def _migrate(
    previous: Plan,
    load: np.ndarray,
    lay: Layout,
    max_moves: int | None,
    min_gain: float,
    tolerance: float,
) -> tuple[np.ndarray, int]:
    """Replica shifts where counts no longer fit the load, then swaps, within the move budget."""
    if previous.layout != lay or previous.phy2log.shape != (load.shape[0], lay.num_replicas):
        raise InputError(
            f"previous plan has layout {previous.layout} and {previous.num_layers} layers; "
            f"it must match this call's {lay} and {load.shape[0]} layers"
        )
    phy2log = previous.phy2log.copy()
    counts = replicate_spread(load, lay.num_replicas, lay.num_gpus)
    target = lower_bound(load, lay.num_replicas, lay.num_gpus, counts=counts) * (1.0 + tolerance)
    domain = lay.gpus_per_node if previous.policy == "hierarchical" else lay.num_gpus

    def budget_left() -> int | None:
        return None if max_moves is None else max_moves - int((phy2log != previous.phy2log).sum())

    def swaps() -> None:
        improve_by_swaps(
            phy2log,
            _slot_loads(load, phy2log, lay),
            lay.num_gpus,
            gpus_per_domain=domain,
            target=target,
            min_gain=min_gain,
            max_total_moves=budget_left(),
            reference=previous.phy2log,
        )

    swaps()
    above = np.flatnonzero(_max_gpu_load(load, phy2log, lay) > target)
    if above.size:
        sub = phy2log[above]
        shifted = shift_replicas(
            sub,
            load[above],
            lay.num_gpus,
            min_gain=min_gain,
            max_total_moves=budget_left(),
            gpus_per_domain=domain,
            reference=previous.phy2log[above],
        )
        phy2log[above] = sub
        if shifted.any():
            swaps()
    return phy2log, int((phy2log != previous.phy2log).sum())


def rebalance(
    load: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    policy: str = "auto",
    previous: Plan | None = None,
    max_moves: int | None = None,
    min_gain: float = 2e-3,
    tolerance: float = 1e-3,
    traffic_weight: float = DEFAULT_TRAFFIC_WEIGHT,
    groups_per_token: int | None = None,
    experts_per_token: int = 8,
) -> Plan:
    """Place ``num_replicas`` expert replicas per layer on ``num_gpus`` GPUs in ``num_nodes`` nodes.

    Args:
        load: ``[L, E]`` expert loads (tokens per expert; numpy or torch).
        num_replicas: physical slots per layer, a multiple of ``num_gpus`` and ``>= E``.
        num_groups: expert groups (``E % num_groups == 0``).
        num_nodes: nodes of the hardware.
        num_gpus: GPUs of the hardware (a multiple of ``num_nodes``).
        policy: ``"auto"`` (default), ``"hierarchical"``, ``"global"`` or ``"deepseek"`` (module doc).
        previous: a plan to migrate from (same layout); keeps replicas in place unless moving pays.
        max_moves: with ``previous``, cap on the number of slots that change, over all layers.
        min_gain: with ``previous``, a swap must lower the heaviest GPU by this fraction of its load.
        tolerance: a layer's search stops once its heaviest GPU is within this fraction of the lower
            bound (:func:`moeinfra.eplb.lower_bound`); 0 searches until no swap helps.
        traffic_weight: ``auto``'s communication/compute weight (module doc).
        groups_per_token: ``auto``'s cost model: groups a token may use (default: the layout's).
        experts_per_token: ``auto``'s cost model: routed experts per token.
    Returns:
        A :class:`Plan`; ``plan.metrics`` holds ``layer_policy`` (per layer) or, when migrating, ``moves``.
    """
    array = to_numpy_load(load, "load")
    lay = check_layout(array.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    if policy not in POLICIES:
        raise InputError(f"policy={policy!r} is not one of {', '.join(POLICIES)}")
    hierarchical_ok = lay.num_groups % lay.num_nodes == 0
    if policy == "hierarchical" and not hierarchical_ok:
        raise InputError(
            f"policy='hierarchical' needs num_groups % num_nodes == 0; got num_groups={num_groups}, "
            f"num_nodes={num_nodes}"
        )
    if max_moves is not None and (
        isinstance(max_moves, bool)
        or not isinstance(max_moves, int | np.integer)
        or max_moves < 0
        or previous is None
    ):
        raise InputError(
            f"max_moves={max_moves!r} must be a whole number >= 0 and needs a previous plan"
        )
    for name, value in (
        ("tolerance", tolerance),
        ("min_gain", min_gain),
        ("traffic_weight", traffic_weight),
    ):
        if not (isinstance(value, int | float | np.number) and math.isfinite(value) and value >= 0):
            raise InputError(f"{name}={value!r} must be a finite number >= 0")
    if previous is not None:
        previous.check("previous plan")
    groups_per_token = groups_per_token or min(4, lay.num_groups)
    if not 1 <= groups_per_token <= lay.num_groups:
        raise InputError(
            f"groups_per_token={groups_per_token} must be in 1..num_groups={lay.num_groups}"
        )

    if previous is not None:
        phy2log, moved = _migrate(previous, array, lay, max_moves, min_gain, tolerance)
        return make_plan(phy2log, array, lay, previous.policy, {"moves": moved})

    layers = array.shape[0]
    if policy == "deepseek":
        ds_phy2log, _, _, ds_hierarchical = deepseek_arrays(
            array, num_replicas, num_groups, num_nodes, num_gpus
        )
        kind = "hierarchical" if ds_hierarchical else "global"
        return make_plan(ds_phy2log, array, lay, "deepseek", {"layer_policy": [kind] * layers})
    counts = replicate_spread(array, lay.num_replicas, lay.num_gpus)
    target = lower_bound(array, lay.num_replicas, lay.num_gpus, counts=counts) * (1.0 + tolerance)
    if policy == "hierarchical" or (policy == "auto" and hierarchical_ok and lay.num_nodes == 1):
        ds_hier = _deepseek_rows(array, lay, True)(np.arange(layers))
        phy2log = _hierarchical(array, lay, ds_hier, target)
        return make_plan(phy2log, array, lay, policy, {"layer_policy": ["hierarchical"] * layers})
    if policy == "global" or not hierarchical_ok:
        phy2log = _global(array, lay, counts, target)
        return make_plan(phy2log, array, lay, policy, {"layer_policy": ["global"] * layers})
    phy2log, is_global = _auto(
        array, lay, counts, target, traffic_weight, groups_per_token, experts_per_token
    )
    chosen = ["global" if g else "hierarchical" for g in is_global]
    return make_plan(phy2log, array, lay, policy, {"layer_policy": chosen})
