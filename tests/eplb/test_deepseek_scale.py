"""``rebalance_experts`` against DeepSeek's EPLB algorithm at DeepSeek-V3 scale.

The reference below is a transcription, in torch, of the steps DeepSeek's ``eplb.py`` publishes
(pack groups onto nodes, replicate inside each node, pack replicas onto GPUs; greedy packing over
items sorted by ``Tensor.sort(descending=True)``). DeepSeek's sort is torch's default one, which is
not stable on rows longer than 16: replicas of one expert carry equal loads, so the order of those
ties, and with it which of them lands in which slot, is torch's choice. What the README promises is
pinned here: with a stable sort the plans are identical; with torch's own sort, replica counts,
every slot's load and every GPU's load are identical and only equal-load slots may trade places.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeinfra.eplb import rebalance_experts

from .conftest import DECODE, PREFILL


def _pack(weight: torch.Tensor, packs: int, stable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy: items by descending weight, each to the lightest pack that still has room."""
    layers, items = weight.shape
    per_pack = items // packs
    if per_pack == 1:
        return torch.arange(items).expand(layers, -1).clone(), torch.zeros(layers, items).long()
    if stable:
        order = weight.float().sort(dim=-1, descending=True, stable=True).indices
    else:  # as DeepSeek's eplb.py calls it
        order = weight.float().sort(-1, descending=True).indices
    pack = torch.full((layers, items), -1, dtype=torch.int64)
    rank = torch.full((layers, items), -1, dtype=torch.int64)
    for layer in range(layers):
        loads, sizes = [0.0] * packs, [0] * packs
        for item in order[layer].tolist():
            target = min((p for p in range(packs) if sizes[p] < per_pack), key=loads.__getitem__)
            pack[layer, item], rank[layer, item] = target, sizes[target]
            loads[target] += weight[layer, item]  # a float32 tensor: summed in float32
            sizes[target] += 1
    return pack, rank


def _replicate(weight: torch.Tensor, slots: int):
    """Each extra slot to the expert with the highest load per replica."""
    layers, experts = weight.shape
    phy2log = torch.arange(slots).repeat(layers, 1)
    rank = torch.zeros(layers, slots, dtype=torch.int64)
    count = torch.ones(layers, experts, dtype=torch.int64)
    rows = torch.arange(layers)
    for slot in range(experts, slots):
        best = (weight / count).max(dim=-1).indices
        phy2log[:, slot], rank[:, slot] = best, count[rows, best]
        count[rows, best] += 1
    return phy2log, rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1)).expand(perm.shape))
    return inv


def reference(weight: np.ndarray, replicas: int, groups: int, nodes: int, gpus: int, stable: bool):
    """``(phy2log, logcnt)`` by DeepSeek's three steps (global policy: one group, one node)."""
    w = torch.from_numpy(weight).float()
    if groups % nodes:
        groups, nodes = 1, 1
    layers, experts = w.shape
    size, per_node, per_gpu = experts // groups, groups // nodes, replicas // gpus
    group_pack, group_rank = _pack(w.unflatten(-1, (groups, size)).sum(-1), nodes, stable)
    log2mlog = (
        ((group_pack * per_node + group_rank) * size).unsqueeze(-1) + torch.arange(size)
    ).flatten(-2)
    mlog2log = _inverse(log2mlog)
    node_load = w.gather(-1, mlog2log).view(-1, experts // nodes)
    phy2mlog, _, mlogcnt = _replicate(node_load, replicas // nodes)
    slot_load = (node_load / mlogcnt).gather(-1, phy2mlog)
    pack, rank = _pack(slot_load, gpus // nodes, stable)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    offsets = torch.arange(0, experts, experts // nodes).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(layers, nodes, -1) + offsets).flatten(-2)
    phy2log = mlog2log.gather(-1, pphy2mlog)
    logcnt = mlogcnt.view(layers, -1).gather(-1, log2mlog)
    return phy2log.numpy(), logcnt.numpy()


def _slot_loads(weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    per_replica = weight.astype(np.float32) / logcnt
    return np.take_along_axis(per_replica, phy2log, axis=1)


CASES = [
    pytest.param(("lognormal", 0), PREFILL, id="lognormal-prefill"),
    pytest.param(("zipf", 1), PREFILL, id="zipf-prefill"),
    pytest.param(("lognormal", 1), DECODE, id="lognormal-decode"),
    pytest.param(
        ("zipf", 0),
        {"num_replicas": 288, "num_groups": 8, "num_nodes": 3, "num_gpus": 48},
        id="zipf-global",
    ),
]


@pytest.mark.parametrize(("kind", "shape"), CASES)
def test_identical_to_the_reference_with_a_stable_sort(v3_loads, kind, shape):
    load = v3_loads[kind]
    ours, _, ours_cnt = rebalance_experts(load, **shape)
    theirs, theirs_cnt = reference(load, *shape.values(), stable=True)
    np.testing.assert_array_equal(ours_cnt, theirs_cnt)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(("kind", "shape"), CASES)
def test_with_torch_sort_only_equal_load_slots_trade_places(v3_loads, kind, shape):
    load = v3_loads[kind]
    ours, _, ours_cnt = rebalance_experts(load, **shape)
    theirs, theirs_cnt = reference(load, *shape.values(), stable=False)
    np.testing.assert_array_equal(ours_cnt, theirs_cnt)  # replica counts
    mine, ref = _slot_loads(load, ours, ours_cnt), _slot_loads(load, theirs, theirs_cnt)
    np.testing.assert_array_equal(mine, ref)  # every slot's load, so every GPU's load
    # the slots that differ hold different experts of the same load per replica
    assert (ours != theirs).any() or shape is not PREFILL  # ties do occur at this scale


@pytest.mark.parametrize(
    ("experts", "layout"),
    [
        (4, (8, 3, 2, 4)),  # vLLM's test_parameter_validation case
        (256, (288, 8, 3, 8)),  # GPUs not a multiple of nodes
        (256, (288, 8, 16, 8)),  # more nodes than GPUs
        (60, (64, 8, 3, 8)),  # experts not divisible into groups
    ],
)
def test_the_global_fallback_accepts_the_layouts_the_reference_accepts(experts, layout):
    """groups % nodes != 0: DeepSeek places as one group on one node and needs nothing of the
    group and node counts; so does rebalance_experts, with the reference's plan."""
    load = np.random.default_rng(experts).lognormal(0, 1, (3, experts)) * 100
    ours, log2phy, count = rebalance_experts(load, *layout)
    theirs, theirs_cnt = reference(load, *layout, stable=True)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(count, theirs_cnt)
    assert log2phy.shape == (3, experts, count.max())


def test_what_the_reference_cannot_place_is_still_refused():
    load = np.ones((1, 60))
    with pytest.raises(ValueError, match="num_groups=8 must divide"):  # hierarchical: 8 % 4 == 0
        rebalance_experts(load, 64, 8, 4, 8)
    with pytest.raises(ValueError, match="multiple of num_gpus"):
        rebalance_experts(load, 66, 8, 3, 8)
    with pytest.raises(ValueError, match="num_nodes=0"):
        rebalance_experts(load, 64, 8, 0, 8)
