"""DeepSeek's published EPLB policy (``rebalance_experts``), reimplemented for all layers at once.

Same contract as DeepSeek's release and the same plan as its algorithm run with a stable sort,
including its float32 arithmetic and its tie-breaking (lowest index wins), but its greedy loops run
numba-compiled over all layers instead of a Python loop over 0-d tensors. DeepSeek's code sorts with
torch's default sort, which is not stable on rows longer than 16; at DeepSeek-V3 scale the
replicas of one expert tie, and DeepSeek's code may put them in other slots: replica counts and
every slot's and GPU's load are identical, equal-load slots may trade places
(``tests/eplb/test_deepseek_scale.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moeinfra.eplb.inputs import check_layout, like_input, positive_int, to_numpy_load
from moeinfra.eplb.jit import kernel
from moeinfra.eplb.packing import descending_order, pack_rows, sift_down
from moeinfra.errors import InputError


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each.

    Items go in descending weight order (stable), each to the lightest pack that still has room
    (lowest index on ties); pack loads are summed in the dtype of ``weight`` (float32 like DeepSeek).

    Args:
        weight: ``[X, n]`` item weights, one packing problem per row.
        num_packs: number of packs; must divide ``n``.
    Returns:
        ``pack_index [X, n]`` (pack of each item) and ``rank_in_pack [X, n]`` (position inside it), int64.
    """
    rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        return (
            np.broadcast_to(np.arange(num_items, dtype=np.int64), weight.shape).copy(),
            np.zeros(weight.shape, dtype=np.int64),
        )
    weight = np.ascontiguousarray(weight)
    bins = np.empty((rows, num_packs, per_pack), dtype=np.int64)
    distinct = np.broadcast_to(np.arange(num_items, dtype=np.int64), weight.shape)
    pack_rows(weight, np.ascontiguousarray(distinct), descending_order(weight), num_packs, bins)
    pack_index = np.empty((rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((rows, num_items), dtype=np.int64)
    flat_bins = bins.reshape(rows, num_items)
    np.put_along_axis(pack_index, flat_bins, np.arange(num_items) // per_pack, axis=1)
    np.put_along_axis(rank_in_pack, flat_bins, np.arange(num_items) % per_pack, axis=1)
    return pack_index, rank_in_pack


@kernel()
def _replicate_rows(weight, phy2log, rank, logcnt):
    """Per row: each redundant slot to the expert with the largest ``weight / count`` (computed in
    the dtype of ``weight``), lowest index on ties: a min-heap on ``(-weight / count, expert)``."""
    rows, num_logical = weight.shape
    keys = np.empty(num_logical, dtype=weight.dtype)
    experts = np.empty(num_logical, dtype=np.int64)
    for row in range(rows):
        for expert in range(num_logical):
            keys[expert] = -weight[row, expert]
            experts[expert] = expert
        for start in range(num_logical // 2 - 1, -1, -1):
            sift_down(keys, experts, num_logical, start)
        for slot in range(num_logical, phy2log.shape[1]):
            expert = experts[0]
            phy2log[row, slot] = expert
            rank[row, slot] = logcnt[row, expert]
            logcnt[row, expert] += 1
            keys[0] = -(weight[row, expert] / weight.dtype.type(logcnt[row, expert]))
            sift_down(keys, experts, num_logical, 0)


def replicate_experts(
    weight: np.ndarray, num_physical: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give redundant replicas, one at a time, to the expert with the largest load per replica.

    Args:
        weight: ``[X, n]`` logical expert loads.
        num_physical: physical slots per row, ``>= n``.
    Returns:
        ``phy2log [X, num_physical]``, ``rank [X, num_physical]`` (replica index of each slot) and
        ``logcnt [X, n]`` (replicas per expert), int64. Slot ``i < n`` holds expert ``i``.
    """
    rows, num_logical = weight.shape
    phy2log = np.broadcast_to(np.arange(num_physical, dtype=np.int64), (rows, num_physical)).copy()
    rank = np.zeros((rows, num_physical), dtype=np.int64)
    logcnt = np.ones((rows, num_logical), dtype=np.int64)
    _replicate_rows(np.ascontiguousarray(weight), phy2log, rank, logcnt)
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(perm)
    np.put_along_axis(
        inverse, perm, np.broadcast_to(np.arange(perm.shape[1], dtype=np.int64), perm.shape), axis=1
    )
    return inverse


def group_nodes(weight: np.ndarray, num_groups: int, num_nodes: int) -> np.ndarray:
    """Step 1 of the hierarchical policy alone: ``[L, E]`` node of each expert (its group's pack)."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(axis=-1)
    group_pack, _ = balanced_packing(tokens_per_group, num_nodes)
    return np.repeat(group_pack, group_size, axis=1)


def rebalance_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek's hierarchical policy: groups to nodes, replicate within nodes, replicas to GPUs.

    Args:
        weight: ``[L, E]`` float32 loads.
    Returns:
        ``phy2log [L, num_physical]``, ``phyrank [L, num_physical]``, ``logcnt [L, E]``, int64.
    """
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_gpu = num_physical // num_gpus
    logical_per_node = num_logical // num_nodes

    # Step 1: pack expert groups onto nodes; relabel experts so each node's are contiguous ("mlog").
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(axis=-1)
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size)[:, :, None]
        + np.arange(group_size, dtype=np.int64)
    ).reshape(num_layers, num_logical)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate experts within each node.
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=-1).reshape(-1, logical_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes)

    # Step 3: pack each node's physical experts onto its GPUs.
    tokens_per_phy = np.take_along_axis(
        tokens_per_mlog / mlogcnt.astype(weight.dtype), phy2mlog, axis=-1
    )
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = pack_index * slots_per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=-1)
    pphy2mlog = (
        pphy2mlog.reshape(num_layers, num_nodes, -1)
        + np.arange(0, num_logical, logical_per_node, dtype=np.int64)[None, :, None]
    ).reshape(num_layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=-1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=-1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, axis=-1)
    return pphy2log, pphyrank, logcnt


def build_log2phy(
    phy2log: np.ndarray, phyrank: np.ndarray, num_logical: int, width: int | None = None
) -> np.ndarray:
    """``[L, E, width]`` physical slots of each logical expert, ordered by replica rank, padded with
    -1 (``width`` default ``R - E + 1``, the most replicas an expert can have)."""
    num_layers, num_replicas = phy2log.shape
    max_replicas = num_replicas - num_logical + 1 if width is None else width
    log2phy = np.full((num_layers, num_logical * max_replicas), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy,
        phy2log * max_replicas + phyrank,
        np.broadcast_to(np.arange(num_replicas, dtype=np.int64), phy2log.shape),
        axis=-1,
    )
    return log2phy.reshape(num_layers, num_logical, max_replicas)


def deepseek_arrays(
    load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """DeepSeek's policy on a checked float64 load; returns ``(phy2log, phyrank, logcnt, hierarchical)``."""
    weight = load.astype(np.float32)
    hierarchical = num_groups % num_nodes == 0
    if hierarchical:
        phy2log, phyrank, logcnt = rebalance_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    return phy2log, phyrank, logcnt, hierarchical


LOG2PHY_WIDTHS = ("deepseek", "max")


def rebalance_experts(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    log2phy_width: str = "deepseek",
) -> tuple[Any, Any, Any]:
    """DeepSeek's EPLB entry point, same contract as its release.

    Hierarchical policy when ``num_groups % num_nodes == 0``, global policy otherwise.

    Args:
        weight: ``[layers, num_logical_experts]`` load statistics (numpy array or torch tensor).
        num_replicas: physical experts, a multiple of ``num_gpus``.
        num_groups: expert groups. num_nodes: server nodes. num_gpus: GPUs, a multiple of ``num_nodes``.
        log2phy_width: ``"deepseek"`` (default, as DeepSeek's release: ``logcnt.max()``, the most
            replicas any expert got) or ``"max"`` (``num_replicas - num_logical_experts + 1``, the
            most any expert could get, a width fixed by the layout, as vLLM's ``log2phy``).
    Returns:
        ``phy2log [layers, num_replicas]``, ``log2phy [layers, num_logical_experts, X]`` padded with -1,
        ``logcnt [layers, num_logical_experts]``; int64, of the same kind (numpy or torch, same
        device) as ``weight``.
    """
    if log2phy_width not in LOG2PHY_WIDTHS:
        raise InputError(f"log2phy_width={log2phy_width!r} is not one of {LOG2PHY_WIDTHS}")
    load = to_numpy_load(weight)
    if positive_int("num_groups", num_groups) % positive_int("num_nodes", num_nodes):
        # the global fallback places as one group on one node: like DeepSeek's, it accepts any
        # group and node counts (experts not divisible into groups, GPUs not into nodes)
        layout = check_layout(load.shape[1], num_replicas, 1, 1, num_gpus)
    else:
        layout = check_layout(load.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, phyrank, logcnt, _ = deepseek_arrays(
        load, layout.num_replicas, layout.num_groups, layout.num_nodes, layout.num_gpus
    )
    width = int(logcnt.max()) if log2phy_width == "deepseek" else None
    log2phy = build_log2phy(phy2log, phyrank, layout.num_experts, width)
    return like_input(phy2log, weight), like_input(log2phy, weight), like_input(logcnt, weight)
