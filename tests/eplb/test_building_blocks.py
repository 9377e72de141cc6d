"""The compiled greedy and local-search steps against straight transcriptions of their rules."""

import numpy as np
import pytest

from moeinfra.eplb.deepseek import replicate_experts
from moeinfra.eplb.local_search import (
    _resort,
    duplicate_slots,
    improve_by_swaps,
    reassign_duplicates,
    repair_duplicates,
    shift_replicas,
)
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


@pytest.mark.parametrize("kind", ["lognormal", "ties"])
@pytest.mark.parametrize("bins,per_bin", [(4, 3), (8, 2), (32, 9), (5, 1), (7, 5)])
def test_packing_follows_the_lightest_bin_rule(bins, per_bin, kind):
    rng = np.random.default_rng(bins)
    counts = replicate_spread(
        rng.lognormal(0, 2, size=(4, bins * per_bin - 3)), bins * per_bin, bins
    )
    groups = expand_counts(counts)
    # small whole numbers tie often: bins leave the heap in the middle and equal loads order by bin
    item_load = _loads(rng, kind, groups.shape)
    got = pack_lightest_first(item_load, bins, groups)
    ungrouped = pack_lightest_first(item_load, bins)
    for row in range(4):
        np.testing.assert_array_equal(got[row], _pack_reference(item_load[row], groups[row], bins))
        np.testing.assert_array_equal(
            ungrouped[row], _pack_reference(item_load[row], range(groups.shape[1]), bins)
        )


def test_packing_follows_the_rule_when_bins_fill_out_of_heap_order():
    """Experts with up to one replica per bin and loads 0-2: a bin found by skipping ones that
    hold the expert fills up away from the heap's root, and the heap's last bin takes its place
    (about 1 case in 400 here; in one of these 2000 it ties with its new parent's load)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        bins, per_bin = int(rng.integers(3, 9)), int(rng.integers(2, 5))
        experts = int(rng.integers(2, bins * per_bin))
        counts = replicate_spread(rng.lognormal(0, 2, size=(1, experts)), bins * per_bin, bins)
        groups = expand_counts(counts)
        item_load = rng.integers(0, 3, size=groups.shape).astype(np.float64)
        np.testing.assert_array_equal(
            pack_lightest_first(item_load, bins, groups)[0],
            _pack_reference(item_load[0], groups[0], bins),
        )


def test_descending_order_keeps_values_apart_above_its_index_bits():
    # four items use the lowest 2 bits of the float for the index: values 4 ulps apart still order
    one = 1.0
    above = np.frombuffer(np.array([one]).view(np.int64) + 4, dtype=np.float64)[0]
    np.testing.assert_array_equal(
        descending_order(np.array([[one, above, 0.5, 0.25]])), [[1, 0, 2, 3]]
    )


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


def test_duplicate_slots_flags_the_second_copy_on_its_gpu_as_a_mask():
    # 2 GPUs x 2 slots: expert 0 twice on GPU 0 (slots 0, 1); expert 1 on both GPUs is no duplicate
    phy2log = np.array([[0, 0, 1, 2], [1, 2, 1, 3]])
    flags = duplicate_slots(phy2log, 2)
    np.testing.assert_array_equal(
        flags, [[False, True, False, False], [False, False, False, False]]
    )
    np.testing.assert_array_equal(phy2log[flags], [0])  # a boolean mask selects the duplicates


def test_repair_swaps_a_duplicate_to_the_gpu_with_the_lowest_pair_maximum():
    # GPU 0 holds expert 0 twice (5 + 5); GPU 1 [1, 2] loads 1 + 4; GPU 2 [3, 4] loads 2 + 3.
    # Moving the second copy (5) to GPU 1 for a slot of load x gives max(10 - (5 - x), 5 + 5 - x):
    # 9 for either slot; to GPU 2, 8 for either: the first of those, expert 3, comes to GPU 0.
    row = [0, 0, 1, 2, 3, 4]
    loads = [5.0, 5.0, 1.0, 4.0, 2.0, 3.0]
    phy2log = np.array([row, row])
    slot_load = np.array([loads, loads])
    assert repair_duplicates(phy2log, slot_load, num_gpus=3, gpus_per_domain=3) == 2
    np.testing.assert_array_equal(phy2log, [[0, 3, 1, 2, 0, 4]] * 2)
    np.testing.assert_array_equal(slot_load, [[5.0, 2.0, 1.0, 4.0, 5.0, 3.0]] * 2)


@pytest.mark.parametrize(
    "order,loads,gpu,expected",
    [
        ([0, 1, 2], [5.0, 1.0, 3.0], 1, [1, 0, 2]),  # the lightest moves to the front
        ([2, 0], [4.0, 0.0, 1.0], 0, [2, 0]),  # a lighter GPU with a higher index stays ahead
        ([0, 2, 1], [1.0, 1.0, 1.0], 1, [0, 1, 2]),  # equal loads: the lower index first
        ([1, 0, 2], [2.0, 9.0, 3.0], 1, [0, 2, 1]),  # a GPU made heavier moves back
    ],
)
def test_resort_puts_a_changed_gpu_in_load_then_index_order(order, loads, gpu, expected):
    by_load = np.array([order])
    _resort(by_load, np.array([loads]), 0, gpu)
    np.testing.assert_array_equal(by_load[0], expected)


def test_swaps_treat_each_layer_as_if_alone():
    rng = np.random.default_rng(11)
    layers, gpus, per_gpu = 5, 4, 3
    experts = np.tile(np.arange(gpus * per_gpu), (layers, 1))
    # layer 0 is balanced already (it stops first); the others need several swaps
    slot_load = rng.lognormal(0, 1, size=experts.shape)
    slot_load[0] = 1.0
    together_experts, together_load = experts.copy(), slot_load.copy()
    target = np.full(layers, 0.0)
    target[0] = 100.0
    moves = improve_by_swaps(together_experts, together_load, gpus, target=target)
    for layer in range(layers):
        alone_experts, alone_load = (
            experts[layer : layer + 1].copy(),
            slot_load[layer : layer + 1].copy(),
        )
        alone = improve_by_swaps(alone_experts, alone_load, gpus, target=target[layer : layer + 1])
        np.testing.assert_array_equal(together_experts[layer], alone_experts[0])
        assert moves[layer] == alone[0]
    assert moves[0] == 0 and moves[1:].min() > 0


@pytest.mark.parametrize("scale", [1e-3, 1e3])
def test_swaps_and_shifts_do_not_depend_on_the_unit_of_load(scale):
    rng = np.random.default_rng(12)
    load = rng.lognormal(0, 1.5, size=(4, 12))
    phy2log = np.tile(np.r_[np.arange(12), np.arange(4)], (4, 1))
    counts = np.stack([np.bincount(row, minlength=12) for row in phy2log])
    slot_load = np.take_along_axis(load / counts, phy2log, axis=1)
    plain, scaled = phy2log.copy(), phy2log.copy()
    moves = improve_by_swaps(plain, slot_load.copy(), 4)
    assert moves.sum() > 0
    np.testing.assert_array_equal(improve_by_swaps(scaled, slot_load * scale, 4), moves)
    np.testing.assert_array_equal(scaled, plain)
    plain, scaled = phy2log.copy(), phy2log.copy()
    shifted = shift_replicas(plain, load, 4, min_gain=0.01)
    assert shifted.sum() > 0
    np.testing.assert_array_equal(shift_replicas(scaled, load * scale, 4, min_gain=0.01), shifted)
    np.testing.assert_array_equal(scaled, plain)


def test_shift_gives_the_heavy_expert_a_replica_on_two_gpus():
    # GPU 0 [0, 1], GPU 1 [2, 1]; loads 8, 2, 2: per replica 8, 1, 2, GPUs 9 and 3. Expert 0 takes
    # expert 1's slot on GPU 1: both GPUs 4 + 2 = 6. Then no reassignment lowers 6 (expert 1's
    # second replica is gone; expert 0 would leave a GPU at 8 + 1).
    phy2log = np.array([[0, 1, 2, 1]])
    moves = shift_replicas(phy2log, np.array([[8.0, 2.0, 2.0]]), 2, min_gain=0.0)
    np.testing.assert_array_equal(phy2log, [[0, 1, 2, 0]])
    assert moves.tolist() == [1]


def test_a_cap_that_is_never_reached_shifts_every_layer_as_without_one():
    """Layers are independent: spending a budget that never runs out, step by step across layers,
    ends where running each layer to the end does (the same donors considered either way)."""
    rng = np.random.default_rng(0)
    experts, gpus = 24, 8
    load = rng.lognormal(0, 1.5, size=(4, experts))
    # every expert once, then 16 redundant replicas on the lightest experts: badly spent, and
    # more donors than the 8 a step considers
    phy2log = np.concatenate(
        [np.tile(np.arange(experts), (4, 1)), np.argsort(load, axis=1)[:, :16]], axis=1
    )
    free, capped, every_donor = phy2log.copy(), phy2log.copy(), phy2log.copy()
    moves = shift_replicas(free, load, gpus, min_gain=0.0)
    assert moves.min() > 0
    shift_replicas(every_donor, load, gpus, min_gain=0.0, donors=experts)
    assert (every_donor != free).any(), "the donor limit must matter in this case"
    np.testing.assert_array_equal(
        shift_replicas(capped, load, gpus, min_gain=0.0, max_total_moves=10**6), moves
    )
    np.testing.assert_array_equal(capped, free)


def _pack_hierarchical_reference(load, ds_phy2log, layout):
    """Each expert stays on the node DeepSeek's plan gives it; per node, its experts in ascending
    id, their replica counts from replicate_spread, packed by the lightest-bin rule."""
    per_node = layout.num_replicas // layout.num_nodes
    out = np.empty((load.shape[0], layout.num_replicas), dtype=np.int64)
    for layer in range(load.shape[0]):
        node_of = {int(e): s // per_node for s, e in enumerate(ds_phy2log[layer])}
        for node in range(layout.num_nodes):
            experts = np.array(sorted(e for e, n in node_of.items() if n == node))
            counts = replicate_spread(load[layer, experts][None], per_node, layout.gpus_per_node)
            local = expand_counts(counts)[0]
            item_load = (load[layer, experts] / counts[0])[local]
            bins = _pack_reference(item_load, local, layout.gpus_per_node)
            out[layer, node * per_node : (node + 1) * per_node] = experts[local[bins.ravel()]]
    return out


@pytest.mark.parametrize("kind", ["lognormal", "ties"])
def test_hierarchical_packing_follows_the_per_node_rule(kind):
    from moeinfra.eplb.deepseek import rebalance_hierarchical
    from moeinfra.eplb.inputs import check_layout
    from moeinfra.eplb.policy import _pack_hierarchical

    rng = np.random.default_rng(21)
    for experts, replicas, groups, nodes, gpus in ((16, 24, 4, 2, 8), (32, 48, 8, 4, 16)):
        layout = check_layout(experts, replicas, groups, nodes, gpus)
        load = _loads(rng, kind, (3, experts)) + (kind == "ties")
        ds_phy2log = rebalance_hierarchical(load, replicas, groups, nodes, gpus)[0]
        np.testing.assert_array_equal(
            _pack_hierarchical(load, ds_phy2log, layout),
            _pack_hierarchical_reference(load, ds_phy2log, layout),
        )


def _swaps_reference(phy2log, slot_load, num_gpus, min_gain=1e-9):
    """improve_by_swaps' rule, searched in full: while some swap between the heaviest GPU (ties:
    the higher index) and another lowers their pair maximum below the heavy load (by min_gain)
    and puts no expert twice on a GPU, take the lowest such maximum; the first found wins a tie,
    searching partners lightest first (ties: lower index), then own and other slots in order."""
    per = phy2log.shape[1] // num_gpus
    for experts, loads in zip(phy2log, slot_load, strict=True):
        while True:
            gpu_load = loads.reshape(num_gpus, per).sum(axis=1)
            order = sorted(range(num_gpus), key=lambda g: (gpu_load[g], g))
            heavy = order[-1]
            held = experts[heavy * per : (heavy + 1) * per]
            best, best_max = None, gpu_load[heavy] * (1.0 - min_gain)
            for gpu in order[:-1]:
                theirs = experts[gpu * per : (gpu + 1) * per]
                for own in range(heavy * per, (heavy + 1) * per):
                    for other in range(gpu * per, (gpu + 1) * per):
                        delta = loads[own] - loads[other]
                        pair_max = max(gpu_load[heavy] - delta, gpu_load[gpu] + delta)
                        if delta <= 0 or pair_max >= best_max:
                            continue
                        if experts[own] in theirs or experts[other] in held:
                            continue
                        best, best_max = (own, other), pair_max
            if best is None:
                break
            own, other = best
            experts[[own, other]] = experts[[other, own]]
            loads[[own, other]] = loads[[other, own]]


def test_swaps_follow_the_rule_with_tied_gpu_loads():
    """Whole-number loads on 16 and 20 GPUs: many GPUs tie, so which partner comes first decides
    the swap (ties by index, as the rule says)."""
    rng = np.random.default_rng(22)
    for gpus in (16, 20):
        replicas = 3 * gpus
        experts = np.tile(np.arange(replicas) % (replicas - 8), (4, 1))
        slot_load = rng.integers(0, 5, size=experts.shape).astype(np.float64)
        want_experts, want_load = experts.copy(), slot_load.copy()
        _swaps_reference(want_experts, want_load, gpus)
        improve_by_swaps(experts, slot_load, gpus)
        np.testing.assert_array_equal(experts, want_experts)
        np.testing.assert_array_equal(slot_load, want_load)


def test_a_capped_swap_budget_goes_to_equal_gains_in_layer_order():
    """20 one-swap layers on 2 GPUs x 2 slots: kind A [4, 3 | 0, 1] gains 3/7 (4 <-> 1: both
    GPUs at 4), kind B [4, 2 | 0, 1] gains 1/3 (6 -> 4). A budget of 5 swaps goes to the five
    A layers of lowest index; the pattern of kinds is one where an unstable sort reorders ties."""
    kind_a = [0, 1, 2, *range(9, 20)]
    slot_load = np.array(
        [[4.0, 3.0, 0.0, 1.0] if layer in kind_a else [4.0, 2.0, 0.0, 1.0] for layer in range(20)]
    )
    experts = np.tile(np.arange(4), (20, 1))
    moves = improve_by_swaps(experts, slot_load, 2, max_total_moves=10)
    assert np.flatnonzero(moves).tolist() == [0, 1, 2, 9, 10]
    assert (moves[[0, 1, 2, 9, 10]] == 2).all()


def _shift_reference(row, load, num_gpus, min_gain, donors=8):
    """shift_replicas' rule on one layer, by recounting: each step, for every expert on the
    heaviest GPU (the first one at the maximum), ascending, and every donor of the ``donors``
    whose load per replica stays lowest after losing one (ties: the lower expert), every slot of
    the donor on a GPU without the receiver becomes the receiver's; the lowest resulting heaviest
    GPU wins (the first found on a tie) if below the current one by more than min_gain."""
    num_experts, per = load.size, row.size // num_gpus
    gpu_of = np.arange(row.size) // per

    def gpu_loads(experts):
        counts = np.bincount(experts, minlength=num_experts)
        return np.bincount(gpu_of, weights=(load / counts)[experts], minlength=num_gpus)

    moves = 0
    while True:
        counts = np.bincount(row, minlength=num_experts)
        after = np.where(counts >= 2, load / np.maximum(counts - 1, 1), np.inf)
        current = gpu_loads(row)
        heavy = int(np.argmax(current))
        donor_list = sorted(range(num_experts), key=lambda e: (after[e], e))[:donors]
        best, best_value = None, current[heavy] * (1.0 - min_gain)
        for receiver in sorted(set(row[gpu_of == heavy].tolist())):
            holders = set(gpu_of[row == receiver].tolist())
            for donor in donor_list:
                if donor == receiver or not np.isfinite(after[donor]):
                    continue
                for slot in np.flatnonzero(row == donor):
                    if gpu_of[slot] in holders:
                        continue
                    trial = row.copy()
                    trial[slot] = receiver
                    value = gpu_loads(trial).max()
                    if value < best_value:
                        best, best_value = (slot, receiver), value
        if best is None:
            return moves
        row[best[0]] = best[1]
        moves += 1


def test_replica_shifts_follow_the_rule_with_tied_donors():
    """Loads in multiples of 12 (every load per replica a whole number, so sums are exact) from
    three values: many donors tie, and the 8 considered are the lowest (ties: lower expert)."""
    rng = np.random.default_rng(23)
    for _ in range(6):
        load = rng.integers(1, 4, size=(1, 32)).astype(np.float64) * 12
        row = np.concatenate([np.arange(32), rng.choice(32, size=16, replace=False)])
        rng.shuffle(row)
        want = row.copy()
        moves = _shift_reference(want, load[0], 8, min_gain=0.0)
        got = row[None].copy()
        assert shift_replicas(got, load, 8, min_gain=0.0).tolist() == [moves]
        np.testing.assert_array_equal(got[0], want)
