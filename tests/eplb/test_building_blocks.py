"""The compiled greedy and local-search steps against straight transcriptions of their rules."""

import numpy as np
import pytest

from moeinfra.eplb.deepseek import replicate_experts
from moeinfra.eplb.local_search import duplicate_slots, improve_by_swaps, reassign_duplicates
from moeinfra.eplb.packing import (
    descending_order,
    expand_counts,
    pack_lightest_first,
    replicate_spread,
)


def _loads(rng, kind, shape):
    if kind == "ties":
        return rng.integers(0, 3, size=shape).astype(np.float64)
    if kind == "zero":
        return np.zeros(shape)
    return rng.lognormal(0, 1.5, size=shape)


@pytest.mark.parametrize("kind", ["ties", "zero", "lognormal"])
def test_replicate_spread_follows_the_greedy_rule(kind):
    rng = np.random.default_rng(1)
    for _ in range(40):
        experts, cap = int(rng.integers(1, 30)), int(rng.integers(1, 6))
        slots = experts + int(rng.integers(0, experts * cap - experts + 1))
        load = _loads(rng, kind, (3, experts))
        got = replicate_spread(load, slots, cap)
        for row in range(3):
            counts = np.ones(experts, dtype=np.int64)
            for _ in range(experts, slots):
                open_ = [e for e in range(experts) if counts[e] < cap]
                best = max(open_, key=lambda e: (load[row, e] / counts[e], -counts[e], -e))
                counts[best] += 1
            np.testing.assert_array_equal(got[row], counts)


def test_deepseek_replication_follows_its_rule():
    rng = np.random.default_rng(2)
    weight = rng.integers(0, 5, size=(5, 12)).astype(np.float32)  # many ties
    phy2log, rank, logcnt = replicate_experts(weight, 20)
    for row in range(5):
        counts = np.ones(12, dtype=np.int64)
        for slot in range(12, 20):
            expert = int(np.argmax(weight[row] / counts.astype(np.float32)))  # first max wins
            assert phy2log[row, slot] == expert
            assert rank[row, slot] == counts[expert]
            counts[expert] += 1
        np.testing.assert_array_equal(logcnt[row], counts)


def test_descending_order_is_a_stable_descending_sort():
    rng = np.random.default_rng(3)
    values = rng.integers(0, 4, size=(6, 300)).astype(np.float64) * rng.lognormal(size=(6, 1))
    values[0, :5] = -0.0
    expected = np.argsort(-values, axis=1, kind="stable")
    np.testing.assert_array_equal(descending_order(values), expected)


def _pack_reference(item_load, item_group, num_bins):
    per_bin = len(item_load) // num_bins
    loads, content = [0.0] * num_bins, [[] for _ in range(num_bins)]
    for item in sorted(range(len(item_load)), key=lambda i: -item_load[i]):
        open_ = [b for b in range(num_bins) if len(content[b]) < per_bin]
        free = [b for b in open_ if item_group[item] not in {item_group[i] for i in content[b]}]
        b = min(free or open_, key=lambda b: (loads[b], b))
        content[b].append(item)
        loads[b] += item_load[item]
    return np.array(content)


@pytest.mark.parametrize("bins,per_bin", [(4, 3), (8, 2), (32, 9), (5, 1)])
def test_packing_follows_the_lightest_bin_rule(bins, per_bin):
    rng = np.random.default_rng(bins)
    counts = replicate_spread(
        rng.lognormal(0, 2, size=(4, bins * per_bin - 3)), bins * per_bin, bins
    )
    groups = expand_counts(counts)
    item_load = rng.lognormal(size=groups.shape)
    got = pack_lightest_first(item_load, bins, groups)
    for row in range(4):
        np.testing.assert_array_equal(got[row], _pack_reference(item_load[row], groups[row], bins))


def test_swaps_lower_the_heaviest_gpu_and_keep_gpus_duplicate_free():
    rng = np.random.default_rng(4)
    layers, gpus, per_gpu = 6, 8, 4
    # experts 0-7 have a second replica (slots 24-31 on GPUs 6-7): swaps must not pair them up
    experts = np.tile(np.arange(gpus * per_gpu) % 24, (layers, 1))
    assert not duplicate_slots(experts, gpus).any()
    slot_load = rng.lognormal(0, 1, size=experts.shape)
    before = slot_load.reshape(layers, gpus, per_gpu).sum(axis=2).max(axis=1)
    pairs_before = sorted(zip(experts.ravel(), slot_load.ravel(), strict=True))
    moves = improve_by_swaps(experts, slot_load, gpus)
    after = slot_load.reshape(layers, gpus, per_gpu).sum(axis=2).max(axis=1)
    assert (after <= before).all() and (after < before).any()
    assert moves.sum() == 2 * (moves.sum() // 2) and moves.sum() > 0
    assert not duplicate_slots(experts, gpus).any()
    # slots moved with their loads: the (expert, load) pairs are the same multiset
    assert sorted(zip(experts.ravel(), slot_load.ravel(), strict=True)) == pairs_before


def test_swaps_respect_the_move_budget_and_domains():
    rng = np.random.default_rng(5)
    experts = np.tile(np.arange(32), (5, 1))
    slot_load = rng.lognormal(0, 1, size=(5, 32))
    moves = improve_by_swaps(experts, slot_load, 8, gpus_per_domain=4, max_total_moves=6)
    assert moves.sum() <= 6
    # experts 0-15 live on GPUs 0-3 (domain 0), 16-31 on GPUs 4-7: swaps stay inside a domain
    assert ((experts[:, :16] < 16).all()) and ((experts[:, 16:] >= 16).all())


def _reassign_reference(phy2log, load, num_gpus, gpus_per_domain):
    """Each duplicate slot (found up front) goes to the expert of its domain, not on its GPU, that
    gives the lowest heaviest GPU after recounting replicas, if that is not above the current one."""
    num_layers, num_replicas = phy2log.shape
    num_experts = load.shape[1]
    slot_gpu = np.arange(num_replicas) // (num_replicas // num_gpus)
    slot_domain = slot_gpu // gpus_per_domain

    def heaviest(experts, weights):
        counts = np.bincount(experts, minlength=num_experts)
        return np.bincount(slot_gpu, weights=(weights / np.maximum(counts, 1))[experts]).max()

    for layer, slot in zip(*np.nonzero(duplicate_slots(phy2log, num_gpus)), strict=True):
        experts = phy2log[layer]
        gpu_experts = experts[slot_gpu == slot_gpu[slot]]
        if (gpu_experts == experts[slot]).sum() < 2:
            continue
        current = heaviest(experts, load[layer])
        domain = set(experts[slot_domain == slot_domain[slot]])
        best, best_load = -1, np.inf
        for candidate in range(num_experts):
            if candidate in gpu_experts or candidate not in domain:
                continue
            trial = experts.copy()
            trial[slot] = candidate
            value = heaviest(trial, load[layer])
            if value < best_load:
                best, best_load = candidate, value
        if best >= 0 and best_load <= current:
            experts[slot] = best


@pytest.mark.parametrize("domain", [None, 2])
def test_duplicate_reassignment_follows_its_rule(domain):
    rng = np.random.default_rng(3)
    for _ in range(30):
        num_gpus, per_gpu = 4, int(rng.integers(2, 5))
        num_experts = int(rng.integers(per_gpu + 1, num_gpus * per_gpu))
        phy2log = rng.integers(0, num_experts, size=(3, num_gpus * per_gpu))
        phy2log[:, :num_experts] = np.arange(num_experts)  # every expert has a replica
        load = rng.lognormal(0, 1.0, size=(3, num_experts))
        expected = phy2log.copy()
        _reassign_reference(expected, load, num_gpus, domain or num_gpus)
        got = phy2log.copy()
        moved = reassign_duplicates(got, load, num_gpus, domain)
        np.testing.assert_array_equal(got, expected)
        assert moved == int((got != phy2log).sum())
