"""Improve a placement by swapping slots between GPUs, layer by layer in numba-compiled loops.

Replica counts stay fixed, so every slot keeps its load (expert load / replica count) and a swap
moves two loads between two GPUs. Each step takes the heaviest GPU of every layer and applies the
swap with one of its slots that most lowers the larger of the two GPUs' new loads (partners are tried
lightest first, which lets the search stop early). The sorted vector
of GPU loads then decreases lexicographically, so the search cannot cycle; it stops when no swap helps
the heaviest GPU, when the move budget is spent, or after ``max_steps``.
"""

from __future__ import annotations

import numpy as np

from moeinfra.eplb.jit import kernel
from moeinfra.eplb.plan import count_replicas, gpu_loads

_NO_CAP = 1 << 62  # an unlimited move budget (room for swaps that give slots back: no overflow)


@kernel()
def _duplicate_rows(phy2log, slots_per_gpu, flags):
    num_layers, num_replicas = phy2log.shape
    for layer in range(num_layers):
        for first in range(0, num_replicas, slots_per_gpu):
            for slot in range(first + 1, first + slots_per_gpu):
                for earlier in range(first, slot):
                    if phy2log[layer, earlier] == phy2log[layer, slot]:
                        flags[layer, slot] = True
                        break


def duplicate_slots(phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[L, R]`` True for each slot whose expert already sits in an earlier slot of the same GPU."""
    flags = np.zeros(phy2log.shape, dtype=bool)
    _duplicate_rows(
        np.ascontiguousarray(phy2log, dtype=np.int64), phy2log.shape[1] // num_gpus, flags
    )
    return flags


def repair_duplicates(
    phy2log: np.ndarray, slot_load: np.ndarray, num_gpus: int, gpus_per_domain: int
) -> int:
    """Swap away second copies of an expert on one GPU, in place; return how many were repaired.

    A copy moves to another GPU of the same domain (node for hierarchical plans, all GPUs for global)
    that does not hold the expert, in exchange for a slot whose expert the first GPU does not hold;
    among those swaps the one with the smallest resulting pair maximum is taken.
    """
    slots_per_gpu = phy2log.shape[1] // num_gpus
    domain_slots = gpus_per_domain * slots_per_gpu
    repaired = 0
    for layer, slot in zip(*np.nonzero(duplicate_slots(phy2log, num_gpus)), strict=True):
        gpu, expert = slot // slots_per_gpu, phy2log[layer, slot]
        start = (gpu // gpus_per_domain) * domain_slots
        experts = phy2log[layer, start : start + domain_slots].reshape(
            gpus_per_domain, slots_per_gpu
        )
        loads = slot_load[layer, start : start + domain_slots].reshape(
            gpus_per_domain, slots_per_gpu
        )
        gpu_sums = loads.sum(axis=1)
        local_gpu = gpu - start // slots_per_gpu
        if (experts[local_gpu] == expert).sum() < 2:  # an earlier swap already resolved it
            continue
        holds_expert = (experts == expert).any(axis=1)
        ok = ~holds_expert[:, None] & ~np.isin(experts, experts[local_gpu])
        if not ok.any():
            continue
        delta = slot_load[layer, slot] - loads
        pair_max = np.maximum(gpu_sums[local_gpu] - delta, gpu_sums[:, None] + delta)
        pick = np.flatnonzero(ok.ravel())[pair_max.ravel()[ok.ravel()].argmin()]
        _swap(phy2log, slot_load, layer, slot, start + pick)
        repaired += 1
    return repaired


def _swap(phy2log, slot_load, layer, slot_a, slot_b) -> None:
    """Exchange slots ``slot_a`` and ``slot_b`` of ``layer`` (scalars, or arrays with distinct layers)."""
    exp_a, exp_b = phy2log[layer, slot_a].copy(), phy2log[layer, slot_b].copy()
    load_a, load_b = slot_load[layer, slot_a].copy(), slot_load[layer, slot_b].copy()
    phy2log[layer, slot_a], phy2log[layer, slot_b] = exp_b, exp_a
    slot_load[layer, slot_a], slot_load[layer, slot_b] = load_b, load_a


@kernel(inline="always")
def _holds_expert(phy2log, layer, gpu, slots_per_gpu, expert):
    for slot in range(gpu * slots_per_gpu, (gpu + 1) * slots_per_gpu):
        if phy2log[layer, slot] == expert:
            return True
    return False


@kernel()
def _best_swap(phy2log, slot_load, gpu_load, by_load, layer, domain_size, slots_per_gpu, bar):
    """The swap of a slot of the heaviest GPU with a slot of another GPU of its domain that gives
    the lowest pair maximum below ``bar``, keeping both GPUs free of duplicate experts; partners are
    tried lightest first, so the search stops at the first GPU whose mean with the heavy one is not
    below the best found. Returns ``(own slot, other slot, pair max)``, ``(-1, -1, bar)`` if none."""
    num_gpus = by_load.shape[1]
    heavy = by_load[layer, num_gpus - 1]
    heavy_load = gpu_load[layer, heavy]
    domain = heavy // domain_size
    best_own, best_other, best_max = -1, -1, bar
    for rank in range(num_gpus - 1):
        gpu = by_load[layer, rank]
        other_load = gpu_load[layer, gpu]
        if heavy_load + other_load >= 2.0 * best_max:  # the pair max is at least their mean
            break
        if gpu // domain_size != domain:
            continue
        for own in range(heavy * slots_per_gpu, (heavy + 1) * slots_per_gpu):
            own_load = slot_load[layer, own]
            own_checked, own_clashes = False, False
            for other in range(gpu * slots_per_gpu, (gpu + 1) * slots_per_gpu):
                delta = own_load - slot_load[layer, other]
                if delta <= 0.0:
                    continue
                pair_max = max(heavy_load - delta, other_load + delta)
                if pair_max >= best_max:
                    continue
                if not own_checked:
                    own_clashes = _holds_expert(
                        phy2log, layer, gpu, slots_per_gpu, phy2log[layer, own]
                    )
                    own_checked = True
                if own_clashes:
                    break
                if _holds_expert(phy2log, layer, heavy, slots_per_gpu, phy2log[layer, other]):
                    continue
                best_own, best_other, best_max = own, other, pair_max
    return best_own, best_other, best_max


@kernel()
def _resort(by_load, gpu_load, layer, gpu):
    """Move ``gpu`` to its place in ``by_load[layer]`` (ascending load, ties by index) after its
    load changed."""
    order, loads = by_load[layer], gpu_load[layer]
    at = 0
    while order[at] != gpu:
        at += 1
    while at > 0 and (
        loads[order[at - 1]] > loads[gpu]
        or (loads[order[at - 1]] == loads[gpu] and order[at - 1] > gpu)
    ):
        order[at] = order[at - 1]
        at -= 1
    while at < order.shape[0] - 1 and (
        loads[order[at + 1]] < loads[gpu]
        or (loads[order[at + 1]] == loads[gpu] and order[at + 1] < gpu)
    ):
        order[at] = order[at + 1]
        at += 1
    order[at] = gpu


@kernel()
def _slots_changed_by_swap(phy2log, reference, layer, a, b):
    """How many more slots of ``layer`` differ from ``reference`` after swapping ``a`` and ``b``."""
    before = int(phy2log[layer, a] != reference[layer, a]) + int(
        phy2log[layer, b] != reference[layer, b]
    )
    after = int(phy2log[layer, b] != reference[layer, a]) + int(
        phy2log[layer, a] != reference[layer, b]
    )
    return after - before


@kernel()
def _swap_rows(
    phy2log,
    slot_load,
    num_gpus,
    domain_size,
    target,
    min_gain,
    max_steps,
    budget,
    reference,
    counted,
    moves,
):
    num_layers, num_replicas = phy2log.shape
    slots_per_gpu = num_replicas // num_gpus
    gpu_load = np.zeros((num_layers, num_gpus))
    by_load = np.empty((num_layers, num_gpus), dtype=np.int64)
    for layer in range(num_layers):
        for slot in range(num_replicas):
            gpu_load[layer, slot // slots_per_gpu] += slot_load[layer, slot]
        by_load[layer] = np.argsort(gpu_load[layer], kind="mergesort")
    active = np.ones(num_layers, dtype=np.bool_)
    own = np.empty(num_layers, dtype=np.int64)
    other = np.empty(num_layers, dtype=np.int64)
    gain = np.empty(num_layers)
    cost = np.empty(num_layers, dtype=np.int64)
    for _ in range(max_steps):
        found = 0
        for layer in range(num_layers):
            gain[layer] = -1.0
            if not active[layer]:
                continue
            heavy_load = gpu_load[layer, by_load[layer, num_gpus - 1]]
            if heavy_load <= target[layer]:
                active[layer] = False
                continue
            a, b, pair_max = _best_swap(
                phy2log,
                slot_load,
                gpu_load,
                by_load,
                layer,
                domain_size,
                slots_per_gpu,
                heavy_load * (1.0 - min_gain),
            )
            if a < 0:
                active[layer] = False
                continue
            own[layer], other[layer] = a, b
            gain[layer] = (heavy_load - pair_max) / heavy_load
            cost[layer] = _slots_changed_by_swap(phy2log, reference, layer, a, b) if counted else 2
            found += 1
        if found == 0:
            break
        wanted = 0
        for layer in range(num_layers):
            if gain[layer] >= 0.0:
                wanted += cost[layer]
        if wanted > budget:
            # The largest relative gains first; a layer whose best swap no longer fits stops.
            order = np.argsort(-gain, kind="mergesort")
            spent = 0
            for rank in range(found):
                layer = order[rank]
                if spent + cost[layer] > budget:
                    gain[layer] = -1.0
                    active[layer] = False
                else:
                    spent += cost[layer]
            if not (gain >= 0.0).any():
                break
        for layer in range(num_layers):
            if gain[layer] < 0.0:
                continue
            a, b = own[layer], other[layer]
            delta = slot_load[layer, a] - slot_load[layer, b]
            gpu_load[layer, a // slots_per_gpu] -= delta
            gpu_load[layer, b // slots_per_gpu] += delta
            _resort(by_load, gpu_load, layer, a // slots_per_gpu)
            _resort(by_load, gpu_load, layer, b // slots_per_gpu)
            phy2log[layer, a], phy2log[layer, b] = phy2log[layer, b], phy2log[layer, a]
            slot_load[layer, a], slot_load[layer, b] = slot_load[layer, b], slot_load[layer, a]
            moves[layer] += 2
            budget -= cost[layer]


def improve_by_swaps(
    phy2log: np.ndarray,
    slot_load: np.ndarray,
    num_gpus: int,
    *,
    gpus_per_domain: int | None = None,
    target: np.ndarray | None = None,
    max_steps: int = 1000,
    min_gain: float = 1e-9,
    max_total_moves: int | None = None,
    reference: np.ndarray | None = None,
) -> np.ndarray:
    """Swap slots between GPUs (within a domain) to lower each layer's heaviest GPU; in place.

    Each step takes the heaviest GPU of every layer and applies its best swap: the one with a slot of
    any other GPU of its domain that gives the lowest maximum of the two GPUs' new loads, if that is
    below the heavy GPU's load by more than ``min_gain`` of it and neither GPU then holds an expert
    twice. A layer stops when its heaviest GPU has no such swap or reaches ``target``.

    Args:
        phy2log: ``[L, R]`` expert per slot (int64, C-contiguous), modified in place.
        slot_load: ``[L, R]`` load per slot (float64, C-contiguous; moves with its slot), in place.
        num_gpus: GPUs per layer. gpus_per_domain: swaps stay inside blocks of this many GPUs
            (GPUs per node keeps a hierarchical plan's node assignment); ``None`` = all GPUs.
        target: ``[L]`` a layer stops once its heaviest GPU is at or below this (e.g. a lower bound).
        max_steps: cap on iterations. min_gain: see above.
        max_total_moves: cap on changed slots over all layers; the swaps with the largest
            relative gains go first (ties: the lower layer), and a layer whose best swap would
            pass the cap stops.
            ``None`` = no cap. A swap costs two slots, or with ``reference`` (``[L, R]``, e.g. the
            plan being migrated from) what it changes in the count of slots that differ from it
            (a swap touching an already changed slot costs less).
    Returns:
        ``[L]`` number of slots swapped per layer (two per swap).
    """
    num_layers = phy2log.shape[0]
    if target is None:
        target = np.full(num_layers, -np.inf)
    moves = np.zeros(num_layers, dtype=np.int64)
    budget = _NO_CAP if max_total_moves is None else int(max_total_moves)
    counted = reference is not None
    _swap_rows(
        phy2log,
        slot_load,
        num_gpus,
        gpus_per_domain or num_gpus,
        np.ascontiguousarray(target, dtype=np.float64),
        float(min_gain),
        int(max_steps),
        budget,
        np.ascontiguousarray(reference if counted else phy2log, dtype=np.int64),
        counted,
        moves,
    )
    return moves


def shift_replicas(
    phy2log: np.ndarray,
    load: np.ndarray,
    num_gpus: int,
    *,
    min_gain: float,
    max_total_moves: int | None = None,
    donors: int = 8,
    gpus_per_domain: int | None = None,
    reference: np.ndarray | None = None,
) -> np.ndarray:
    """Move replicas between experts (one slot changes its expert) while that lowers the heaviest GPU.

    A load shift can change how many replicas an expert deserves, which swaps cannot fix. Each step
    tries giving one more replica to an expert on the heaviest GPU, taken from one of the ``donors``
    experts whose load per replica stays lowest after losing one, in every slot of the donor on a GPU
    that does not hold the receiver yet; it applies the change with the lowest resulting heaviest GPU
    if that is below the current one by more than ``min_gain`` of it. With ``gpus_per_domain``
    (GPUs per node for hierarchical plans) the new replica must land in a domain that already holds
    the receiver, so expert groups stay on their node. In place; compiled per layer.

    Args:
        phy2log: ``[L, R]`` modified in place. load: ``[L, E]``.
        max_total_moves: cap on changed slots over all layers. Under a cap each step applies,
            of every layer's best reassignment, the one with the largest relative gain (ties: the
            lower layer) that fits; without one, layer after layer to the end. A reassignment
            costs one slot, or with ``reference`` (``[L, R]``, e.g. the plan being migrated from)
            what it changes in the count of slots that differ from it.
    Returns:
        ``[L]`` slots reassigned per layer.
    """
    num_layers, num_replicas = phy2log.shape
    counted = reference is not None
    slot_gpu = np.arange(num_replicas) // (num_replicas // num_gpus)
    slot_domain = slot_gpu // (gpus_per_domain or num_gpus)
    budget = _NO_CAP if max_total_moves is None else int(max_total_moves)
    moves = np.zeros(num_layers, dtype=np.int64)
    load = np.ascontiguousarray(load, dtype=np.float64)
    args = (slot_gpu, slot_domain, num_gpus, min_gain)
    if max_total_moves is None:
        for layer in range(num_layers):
            row = np.ascontiguousarray(phy2log[layer])
            moves[layer] = _shift_layer(row, load[layer], *args, budget, donors)
            phy2log[layer] = row
        return moves
    rows = np.ascontiguousarray(phy2log, dtype=np.int64)
    refs = np.ascontiguousarray(reference if counted else rows, dtype=np.int64)

    def best_step(layer: int) -> tuple[float, np.ndarray | None, int]:
        """The layer's best reassignment: (relative gain, the row after it, its cost)."""
        row = rows[layer].copy()
        if not _shift_layer(row, load[layer], *args, 1, donors):
            return -1.0, None, 0
        pair = np.stack([rows[layer], row])
        weights = np.broadcast_to(load[layer], (2, load.shape[1]))
        before, after = gpu_loads(weights, pair, count_replicas(pair, load.shape[1]), num_gpus).max(
            axis=1
        )
        slot = int(np.flatnonzero(row != rows[layer])[0])
        cost = 1
        if counted:
            cost = int(row[slot] != refs[layer, slot]) - int(rows[layer, slot] != refs[layer, slot])
        return (before - after) / before, row, cost

    steps = [best_step(layer) for layer in range(num_layers)]
    while True:
        fits = [g if row is not None and c <= budget else -1.0 for g, row, c in steps]
        layer = int(np.argmax(fits))
        if fits[layer] < 0.0:
            break
        _, row, cost = steps[layer]
        rows[layer] = row
        moves[layer] += 1
        budget -= cost
        steps[layer] = best_step(layer)
    phy2log[:] = rows
    return moves


@kernel()
def _shift_layer(
    experts, weights, slot_gpu, slot_domain, num_gpus, min_gain, budget, donors
):  # pragma: no cover
    """One layer of :func:`shift_replicas`; returns the slots reassigned."""
    num_replicas = experts.size
    num_experts = weights.size
    counts = np.zeros(num_experts, dtype=np.int64)
    for slot in range(num_replicas):
        counts[experts[slot]] += 1
    per_replica = np.empty(num_experts)
    after_loss = np.empty(num_experts)
    gpu_load = np.empty(num_gpus)
    on_gpu = np.zeros(num_gpus, dtype=np.int64)  # receiver's / donor's slots per GPU
    donor_on = np.zeros(num_gpus, dtype=np.int64)
    in_domain = np.zeros(num_replicas, dtype=np.bool_)
    is_receiver = np.zeros(num_experts, dtype=np.bool_)
    new = np.empty(num_gpus)
    moves = 0
    while moves < budget:
        for e in range(num_experts):
            per_replica[e] = weights[e] / counts[e]
            after_loss[e] = weights[e] / max(counts[e] - 1, 1) if counts[e] >= 2 else np.inf
        gpu_load[:] = 0.0
        for slot in range(num_replicas):
            gpu_load[slot_gpu[slot]] += per_replica[experts[slot]]
        heavy = np.argmax(gpu_load)
        best_value = gpu_load[heavy] * (1.0 - min_gain)
        best_slot, best_receiver = -1, -1
        is_receiver[:] = False
        for slot in range(num_replicas):
            if slot_gpu[slot] == heavy:
                is_receiver[experts[slot]] = True
        donor_order = np.argsort(after_loss, kind="mergesort")[:donors]
        for receiver in range(num_experts):  # ascending, as np.unique
            if not is_receiver[receiver]:
                continue
            on_gpu[:] = 0
            for slot in range(num_replicas):
                if experts[slot] == receiver:
                    on_gpu[slot_gpu[slot]] += 1
            for slot in range(num_replicas):
                in_domain[slot] = False
            for slot in range(num_replicas):
                if experts[slot] == receiver:
                    for other in range(num_replicas):
                        if slot_domain[other] == slot_domain[slot]:
                            in_domain[other] = True
            gained = weights[receiver] / (counts[receiver] + 1)
            gain_per = gained - per_replica[receiver]
            for d in range(donor_order.size):
                donor = donor_order[d]
                if donor == receiver or not np.isfinite(after_loss[donor]):
                    continue
                loss_per = after_loss[donor] - per_replica[donor]
                donor_on[:] = 0
                for slot in range(num_replicas):
                    if experts[slot] == donor:
                        donor_on[slot_gpu[slot]] += 1
                for g in range(num_gpus):
                    new[g] = (gpu_load[g] + on_gpu[g] * gain_per) + donor_on[g] * loss_per
                top = 0
                for g in range(1, num_gpus):
                    if new[g] > new[top]:
                        top = g
                second = top
                if num_gpus > 1:
                    second = 1 if top == 0 else 0
                    for g in range(num_gpus):
                        if g != top and new[g] > new[second]:
                            second = g
                pick, pick_value = -1, np.inf
                for slot in range(num_replicas):
                    g = slot_gpu[slot]
                    if experts[slot] != donor or on_gpu[g] > 0 or not in_domain[slot]:
                        continue
                    at_cand = new[g] - after_loss[donor] + gained
                    others = new[second] if g == top else new[top]
                    resulting = max(at_cand, others)
                    if resulting < pick_value:
                        pick, pick_value = slot, resulting
                if pick >= 0 and pick_value < best_value:
                    best_value, best_slot, best_receiver = pick_value, pick, receiver
        if best_slot < 0:
            break
        counts[experts[best_slot]] -= 1
        counts[best_receiver] += 1
        experts[best_slot] = best_receiver
        moves += 1
    return moves


def reassign_duplicates(
    phy2log: np.ndarray, load: np.ndarray, num_gpus: int, gpus_per_domain: int | None = None
) -> int:
    """Give each remaining second copy of an expert on one GPU to another expert, if that is free.

    Swaps cannot always remove a duplicate (every swap may raise the heaviest GPU). A duplicate slot
    can instead hold another expert: the slot is reassigned to the expert (not yet on that GPU) that
    gives the lowest heaviest GPU after recounting replicas, and only if that is not above the current
    heaviest GPU. With ``gpus_per_domain`` (GPUs per node for hierarchical plans) only experts
    already in the slot's domain qualify, so expert groups stay on their node. In place; returns how
    many slots were reassigned.
    """
    flags = duplicate_slots(phy2log, num_gpus)
    if not flags.any():
        return 0
    target = np.ascontiguousarray(phy2log, dtype=np.int64)
    count = _reassign_rows(
        target,
        np.ascontiguousarray(load, dtype=np.float64),
        num_gpus,
        gpus_per_domain or num_gpus,
        flags,
    )
    phy2log[...] = target
    return int(count)


@kernel()
def _reassign_rows(phy2log, load, num_gpus, gpus_per_domain, flags):
    num_layers, num_replicas = phy2log.shape
    num_experts = load.shape[1]
    per_gpu = num_replicas // num_gpus
    per_domain = per_gpu * gpus_per_domain
    counts = np.zeros(num_experts, dtype=np.int64)
    gpu_load = np.zeros(num_gpus)
    trial = np.zeros(num_gpus)
    on_gpu = np.zeros(num_experts, dtype=np.bool_)
    in_domain = np.zeros(num_experts, dtype=np.bool_)
    reassigned = 0
    for layer in range(num_layers):
        for slot in range(num_replicas):
            if not flags[layer, slot]:
                continue
            experts = phy2log[layer]
            expert = experts[slot]
            gpu = slot // per_gpu
            counts[:] = 0
            for r in range(num_replicas):
                counts[experts[r]] += 1
            copies = 0
            for r in range(gpu * per_gpu, (gpu + 1) * per_gpu):
                copies += experts[r] == expert
            if counts[expert] < 2 or copies < 2:
                continue
            current = _heaviest(experts, load[layer], counts, per_gpu, gpu_load)
            on_gpu[:] = False
            in_domain[:] = False
            for r in range(gpu * per_gpu, (gpu + 1) * per_gpu):
                on_gpu[experts[r]] = True
            start = (slot // per_domain) * per_domain
            for r in range(start, start + per_domain):
                in_domain[experts[r]] = True
            best, best_load = -1, np.inf
            for candidate in range(num_experts):
                if on_gpu[candidate] or not in_domain[candidate]:
                    continue
                experts[slot] = candidate
                counts[expert] -= 1
                counts[candidate] += 1
                heaviest = _heaviest(experts, load[layer], counts, per_gpu, trial)
                counts[expert] += 1
                counts[candidate] -= 1
                experts[slot] = expert
                if heaviest < best_load:
                    best, best_load = candidate, heaviest
            if best >= 0 and best_load <= current:
                experts[slot] = best
                reassigned += 1
    return reassigned


@kernel(inline="always")
def _heaviest(experts, load, counts, per_gpu, gpu_load):
    """Heaviest GPU of one layer, each slot carrying its expert's load over its replica count."""
    gpu_load[:] = 0.0
    for r in range(experts.size):
        gpu_load[r // per_gpu] += load[experts[r]] / counts[experts[r]]
    return gpu_load.max()
