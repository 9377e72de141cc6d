"""Construction steps of moeinfra's own policies: spread-aware replication and greedy packing.

Both loop over layers in numba-compiled code: per layer they are sequential greedy algorithms
(a few hundred dependent steps), which numpy can only express as hundreds of whole-array calls.
They produce a starting placement that :mod:`local_search` improves.
"""

from __future__ import annotations

import numpy as np

from moeinfra.eplb.jit import kernel


@kernel(inline="always")
def _gets_replica_first(load, count, a, b):
    """Whether expert ``a`` precedes ``b`` for the next replica: larger load per replica, then
    fewer replicas, then lower index (cross-multiplied: ``load / count`` without division)."""
    left, right = load[a] * count[b], load[b] * count[a]
    if left != right:
        return left > right
    return count[a] < count[b] or (count[a] == count[b] and a < b)


@kernel(inline="always")
def _sift_experts(heap, size, load, count, parent):
    while True:
        first, left, right = parent, 2 * parent + 1, 2 * parent + 2
        if left < size and _gets_replica_first(load, count, heap[left], heap[first]):
            first = left
        if right < size and _gets_replica_first(load, count, heap[right], heap[first]):
            first = right
        if first == parent:
            return
        heap[parent], heap[first] = heap[first], heap[parent]
        parent = first


@kernel()
def _replicate_rows(load, num_slots, max_per_expert, counts):
    num_layers, num_experts = load.shape
    heap = np.empty(num_experts, dtype=np.int64)
    for layer in range(num_layers):
        row, count = load[layer], counts[layer]
        for expert in range(num_experts):
            heap[expert] = expert
        size = num_experts
        for parent in range(num_experts // 2 - 1, -1, -1):
            _sift_experts(heap, size, row, count, parent)
        for _ in range(num_experts, num_slots):
            best = heap[0]
            count[best] += 1
            if count[best] >= max_per_expert:
                size -= 1
                heap[0] = heap[size]
            _sift_experts(heap, size, row, count, 0)


def replicate_spread(load: np.ndarray, num_slots: int, max_per_expert: int) -> np.ndarray:
    """Replica counts minimising the largest load per replica, at most ``max_per_expert`` each.

    Greedy: each redundant slot goes to the expert with the largest load per replica; ties go to the
    expert with fewer replicas, then the lower index — so all-zero loads spread replicas round-robin
    instead of piling them on expert 0. Greedy is optimal for the min-max objective.

    Args:
        load: ``[L, E]`` expert loads. num_slots: slots per layer (``>= E``).
        max_per_expert: cap on replicas of one expert (``num_gpus`` keeps replicas on distinct GPUs).
    Returns:
        ``[L, E]`` int64 replica counts summing to ``num_slots`` per layer.
    """
    num_layers, num_experts = load.shape
    counts = np.ones((num_layers, num_experts), dtype=np.int64)
    capacity = num_experts * max_per_expert
    _replicate_rows(
        np.ascontiguousarray(load, dtype=np.float64),
        min(num_slots, capacity),
        max_per_expert,
        counts,
    )
    if num_slots > capacity:  # more slots than distinct GPUs can take: fill evenly past the cap
        extra = num_slots - capacity
        counts += extra // num_experts
        counts[:, : extra % num_experts] += 1
    return counts


def expand_counts(counts: np.ndarray) -> np.ndarray:
    """``[L, sum(counts)]`` expert ids, expert ``e`` repeated ``counts[l, e]`` times (ascending)."""
    num_layers, num_experts = counts.shape
    experts = np.tile(np.arange(num_experts, dtype=np.int64), num_layers)
    return np.repeat(experts, counts.ravel()).reshape(num_layers, -1)


def descending_order(values: np.ndarray) -> np.ndarray:
    """``[L, n]`` indices that sort each row of non-negative ``values`` descending, ties by index.

    Sorts int64 keys (the float's bit pattern, which orders non-negative floats, with its lowest
    ``log2(n)`` bits replaced by the index), several times faster than a stable ``argsort``; values
    that differ only in those lowest bits (a relative 1e-13 for ``n = 288``) count as ties.
    """
    num_items = values.shape[1]
    index_bits = max(1, int(num_items - 1).bit_length())
    positive = np.asarray(values, dtype=np.float64) + 0.0  # + 0.0 turns -0.0 into 0.0
    bits = positive.view(np.int64) >> index_bits
    keys = ((np.iinfo(np.int64).max >> index_bits) - bits) << index_bits | np.arange(num_items)
    return np.sort(keys, axis=1) & ((1 << index_bits) - 1)


@kernel()
def sift_down(keys, ids, size, parent):
    """Restore the min-heap on ``(keys, ids)`` below ``parent`` (ties: lower id first)."""
    key, item = keys[parent], ids[parent]
    while True:
        child = 2 * parent + 1
        if child >= size:
            break
        right = child + 1
        if right < size and (
            keys[right] < keys[child] or (keys[right] == keys[child] and ids[right] < ids[child])
        ):
            child = right
        if keys[child] > key or (keys[child] == key and ids[child] > item):
            break
        keys[parent], ids[parent] = keys[child], ids[child]
        parent = child
    keys[parent], ids[parent] = key, item


@kernel()
def _sift_up(keys, ids, child):
    key, item = keys[child], ids[child]
    while child > 0:
        parent = (child - 1) // 2
        if keys[parent] < key or (keys[parent] == key and ids[parent] < item):
            break
        keys[child], ids[child] = keys[parent], ids[parent]
        child = parent
    keys[child], ids[child] = key, item


@kernel()
def _holds(bin_groups, filled, b, group):
    for k in range(filled[b]):  # noqa: SIM110 (numba compiles no generator expressions)
        if bin_groups[b, k] == group:
            return True
    return False


@kernel()
def pack_rows(item_load, item_group, order, num_bins, bins):
    """Lightest-open-bin greedy per layer, bin loads summed in the dtype of ``item_load``; writes
    ``bins [L, num_bins, n / num_bins]``. Open bins sit in a min-heap on (load, bin)."""
    num_layers, num_items = item_load.shape
    per_bin = num_items // num_bins
    filled = np.zeros(num_bins, dtype=np.int64)
    bin_groups = np.empty((num_bins, per_bin), dtype=np.int64)
    keys = np.empty(num_bins, dtype=item_load.dtype)
    ids = np.empty(num_bins, dtype=np.int64)
    for layer in range(num_layers):
        filled[:] = 0
        keys[:] = 0.0
        for b in range(num_bins):
            ids[b] = b
        size = num_bins
        for item in order[layer]:
            group = item_group[layer, item]
            pos = 0
            if _holds(bin_groups, filled, ids[0], group):
                # the lightest open bin without the group (rare: scan the heap)
                best = -1
                for p in range(1, size):
                    if not _holds(bin_groups, filled, ids[p], group) and (
                        best < 0
                        or keys[p] < keys[best]
                        or (keys[p] == keys[best] and ids[p] < ids[best])
                    ):
                        best = p
                pos = max(best, 0)
            b = ids[pos]
            bins[layer, b, filled[b]] = item
            bin_groups[b, filled[b]] = group
            filled[b] += 1
            keys[pos] += item_load[layer, item]
            if filled[b] == per_bin:  # full: leaves the heap
                size -= 1
                keys[pos], ids[pos] = keys[size], ids[size]
                if pos < size:
                    _sift_up(keys, ids, pos)
                    sift_down(keys, ids, size, pos)
            else:
                sift_down(keys, ids, size, pos)


def pack_lightest_first(
    item_load: np.ndarray, num_bins: int, item_group: np.ndarray | None = None
) -> np.ndarray:
    """Assign items to bins of equal size, heaviest item first, each to the lightest open bin.

    With ``item_group`` (e.g. the expert of each replica) an item skips bins that already hold its
    group while another open bin does not, so replicas of one expert land on distinct bins whenever
    the greedy order allows; the swap search repairs the rest. Ties go to the lower bin index. With
    two items per bin this pairs the largest with the smallest, which is optimal.

    Args:
        item_load: ``[L, n]``, ``n`` a multiple of ``num_bins``. item_group: ``[L, n]`` or ``None``.
    Returns:
        ``[L, num_bins, n / num_bins]`` item indices per bin.
    """
    num_layers, num_items = item_load.shape
    groups = np.arange(num_items) if item_group is None else item_group
    bins = np.empty((num_layers, num_bins, num_items // num_bins), dtype=np.int64)
    item_load = np.ascontiguousarray(item_load, dtype=np.float64)
    pack_rows(
        item_load,
        np.ascontiguousarray(np.broadcast_to(groups, item_load.shape), dtype=np.int64),
        descending_order(item_load),
        num_bins,
        bins,
    )
    return bins
