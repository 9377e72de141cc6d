"""Construction steps of moeinfra's own policies: spread-aware replication and round-based packing.

Both are vectorised over layers. They produce a starting placement that :mod:`local_search` improves.
"""

from __future__ import annotations

import numpy as np


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
    rows = np.arange(num_layers)
    capacity = num_experts * max_per_expert
    for _ in range(num_experts, min(num_slots, capacity)):
        per_replica = np.where(counts < max_per_expert, load / counts, -np.inf)
        best = per_replica.max(axis=1, keepdims=True)
        tie_break = np.where(per_replica == best, counts, np.iinfo(np.int64).max)
        counts[rows, tie_break.argmin(axis=1)] += 1
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


def _clashes(
    held: np.ndarray, groups: np.ndarray, target: np.ndarray, layers: np.ndarray
) -> np.ndarray:
    """Per layer in ``layers``: items whose group already sits in the bin ``target`` sends them to."""
    in_bin = held[layers[:, None], target]
    return (in_bin == groups[layers][:, :, None]).any(axis=2).sum(axis=1)


def round_robin_pack(
    item_load: np.ndarray, num_bins: int, item_group: np.ndarray | None = None
) -> np.ndarray:
    """Assign items to bins of equal size in rounds: each round gives one item to every bin.

    Items are taken in descending load order; in each round the heaviest remaining item goes to the
    currently lightest bin, the next to the next lightest, and so on. With two items per bin this is
    the optimal pairing (largest with smallest).

    With ``item_group`` (e.g. the expert of each replica), a round whose pairing would put an item into
    a bin that already holds its group is rotated by one to three places (the smallest rotation with
    the fewest such clashes), so few duplicates are left for the swap search to repair.

    Args:
        item_load: ``[L, n]``, ``n`` a multiple of ``num_bins``. item_group: ``[L, n]`` or ``None``.
    Returns:
        ``[L, num_bins, n / num_bins]`` item indices per bin.
    """
    num_layers, num_items = item_load.shape
    per_bin = num_items // num_bins
    order = np.argsort(-item_load, axis=1, kind="stable")
    sorted_load = np.take_along_axis(item_load, order, axis=1)
    sorted_group = None if item_group is None else np.take_along_axis(item_group, order, axis=1)
    bin_load = np.zeros((num_layers, num_bins))
    bins = np.empty((num_layers, num_bins, per_bin), dtype=np.int64)
    bin_groups = np.empty((num_layers, num_bins, per_bin), dtype=np.int64)
    for round_index in range(per_bin):
        lightest_first = np.argsort(bin_load, axis=1, kind="stable")
        chunk = slice(round_index * num_bins, (round_index + 1) * num_bins)
        if sorted_group is not None and round_index > 0:
            held = bin_groups[:, :, :round_index]
            groups = sorted_group[:, chunk]
            every = np.arange(num_layers)
            clashing = every[_clashes(held, groups, lightest_first, every) > 0]
            if clashing.size:
                options = [np.roll(lightest_first[clashing], -shift, axis=1) for shift in range(4)]
                counts = np.stack([_clashes(held, groups, option, clashing) for option in options])
                lightest_first[clashing] = np.stack(options)[
                    counts.argmin(axis=0), np.arange(clashing.size)
                ]
        np.put_along_axis(bins[:, :, round_index], lightest_first, order[:, chunk], axis=1)
        if sorted_group is not None:
            np.put_along_axis(
                bin_groups[:, :, round_index], lightest_first, sorted_group[:, chunk], axis=1
            )
        np.put_along_axis(
            bin_load,
            lightest_first,
            np.take_along_axis(bin_load, lightest_first, axis=1) + sorted_load[:, chunk],
            axis=1,
        )
    return bins
