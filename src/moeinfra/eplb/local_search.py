"""Improve a placement by swapping slots between GPUs, vectorised over layers.

Replica counts stay fixed, so every slot keeps its load (expert load / replica count) and a swap
moves two loads between two GPUs. Each step takes the heaviest GPU of every layer and applies the
swap with one of its slots that most lowers the larger of the two GPUs' new loads. The sorted vector
of GPU loads then decreases lexicographically, so the search cannot cycle; it stops when no swap helps
the heaviest GPU, when the move budget is spent, or after ``max_steps``.
"""

from __future__ import annotations

import numpy as np


def duplicate_slots(phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[L, R]`` True for each slot whose expert already sits in an earlier slot of the same GPU."""
    num_layers, num_replicas = phy2log.shape
    per_gpu = phy2log.reshape(num_layers, num_gpus, -1)
    order = np.argsort(per_gpu, axis=2, kind="stable")
    ordered = np.take_along_axis(per_gpu, order, axis=2)
    repeat = np.zeros_like(ordered, dtype=bool)
    repeat[:, :, 1:] = ordered[:, :, 1:] == ordered[:, :, :-1]
    flags = np.empty_like(repeat)
    np.put_along_axis(flags, order, repeat, axis=2)
    return flags.reshape(num_layers, num_replicas)


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


def improve_by_swaps(
    phy2log: np.ndarray,
    slot_load: np.ndarray,
    num_gpus: int,
    *,
    gpus_per_domain: int | None = None,
    heavy_gpus: int = 2,
    partner_gpus: int = 4,
    target: np.ndarray | None = None,
    max_steps: int = 500,
    min_gain: float = 1e-9,
    max_total_moves: int | None = None,
) -> np.ndarray:
    """Swap slots between GPUs (within a domain) to lower each layer's heaviest GPUs; in place.

    Each step takes the ``heavy_gpus`` heaviest GPUs of every layer; the ``i``-th of them may swap with
    the lightest GPUs of its domain at ranks ``i, i + heavy_gpus, ...`` (``partner_gpus`` of them), so
    the swaps of one step touch disjoint GPUs and can be applied together. A swap is applied if it
    lowers its heavy GPU by more than ``min_gain`` of that GPU's load without raising the partner to
    that load. A layer stops when its heaviest GPU has no such swap or reaches ``target``.

    Args:
        phy2log: ``[L, R]`` expert per slot, modified in place.
        slot_load: ``[L, R]`` load per slot (moves with its slot), modified in place.
        num_gpus: GPUs per layer. gpus_per_domain: swaps stay inside blocks of this many GPUs
            (GPUs per node keeps a hierarchical plan's node assignment); ``None`` = all GPUs.
        heavy_gpus: heavy GPUs improved per step (1 = only the heaviest, for budgeted migration).
        partner_gpus: light GPUs each heavy GPU may swap with.
        target: ``[L]`` a layer stops once its heaviest GPU is at or below this (e.g. a lower bound).
        max_steps: cap on iterations. min_gain: see above.
        max_total_moves: cap on changed slots over all layers (a swap changes two); when a step
            would exceed it, the swaps with the largest relative gains go first. ``None`` = no cap.
    Returns:
        ``[L]`` number of slots changed per layer.
    """
    num_layers, num_replicas = phy2log.shape
    slots_per_gpu = num_replicas // num_gpus
    domain_size = gpus_per_domain or num_gpus
    num_heavy = max(1, min(heavy_gpus, domain_size // 2))
    num_partners = min(partner_gpus, (domain_size - num_heavy) // num_heavy)
    gpu_domain = np.arange(num_gpus) // domain_size
    moves = np.zeros(num_layers, dtype=np.int64)
    budget = np.iinfo(np.int64).max if max_total_moves is None else int(max_total_moves)
    active = np.full(num_layers, budget >= 2 and num_partners > 0)
    rows = np.arange(num_layers)
    own_offsets = np.arange(slots_per_gpu)
    partner_ranks = np.arange(num_heavy)[:, None] + num_heavy * np.arange(num_partners)  # [H, P]
    for _ in range(max_steps):
        layers = rows[active]
        if layers.size == 0:
            break
        count = layers.size
        load = slot_load[layers]
        gpu_load = load.reshape(count, num_gpus, slots_per_gpu).sum(axis=2)
        heavy = np.argsort(-gpu_load, axis=1, kind="stable")[
            :, :num_heavy
        ]  # [A, H], heaviest first
        heavy_load = np.take_along_axis(gpu_load, heavy, axis=1)
        if target is not None:
            done = heavy_load[:, 0] <= target[layers]
            if done.any():
                active[layers[done]] = False
                continue
        heavy_slots = heavy[:, :, None] * slots_per_gpu + own_offsets  # [A, H, S]
        experts = phy2log[layers]
        heavy_slot_load = np.take_along_axis(load, heavy_slots.reshape(count, -1), axis=1).reshape(
            heavy_slots.shape
        )
        heavy_experts = np.take_along_axis(experts, heavy_slots.reshape(count, -1), axis=1).reshape(
            heavy_slots.shape
        )

        is_heavy = np.zeros((count, num_gpus), dtype=bool)
        np.put_along_axis(is_heavy, heavy, True, axis=1)
        outside = gpu_domain[None, None, :] != gpu_domain[heavy][:, :, None]  # [A, H, G]
        ranked = np.where(outside | is_heavy[:, None, :], np.inf, gpu_load[:, None, :])
        by_lightness = np.argsort(ranked, axis=2, kind="stable")
        light = np.take_along_axis(
            by_lightness, np.broadcast_to(partner_ranks, (count, *partner_ranks.shape)), axis=2
        )
        light_load = np.take_along_axis(ranked, light, axis=2)  # [A, H, P]
        partner_slots = (light[..., None] * slots_per_gpu + own_offsets).reshape(
            count, num_heavy, -1
        )
        partner_load = np.take_along_axis(load, partner_slots.reshape(count, -1), axis=1).reshape(
            partner_slots.shape
        )
        partner_experts = np.take_along_axis(
            experts, partner_slots.reshape(count, -1), axis=1
        ).reshape(partner_slots.shape)

        delta = heavy_slot_load[..., None] - partner_load[:, :, None, :]  # [A, H, S, P*S]
        pair_max = np.maximum(
            heavy_load[:, :, None, None] - delta,
            np.repeat(light_load, slots_per_gpu, axis=2)[:, :, None, :] + delta,
        )
        # A swap must not put an expert on a GPU that already holds it.
        partner_grid = partner_experts.reshape(count, num_heavy, 1, num_partners, slots_per_gpu)
        partner_gpu_has = (heavy_experts[..., None, None] == partner_grid).any(
            axis=4
        )  # [A, H, S, P]
        heavy_has = (partner_experts[..., None] == heavy_experts[:, :, None, :]).any(
            axis=3
        )  # [A, H, P*S]
        allowed = (
            (delta > 0)
            & ~np.repeat(partner_gpu_has, slots_per_gpu, axis=3)
            & ~heavy_has[:, :, None, :]
        )
        gain = np.where(allowed, heavy_load[:, :, None, None] - pair_max, -np.inf).reshape(
            count, num_heavy, -1
        )
        flat_best = gain.argmax(axis=2)  # [A, H]
        best_gain = np.take_along_axis(gain, flat_best[..., None], axis=2)[..., 0]
        apply = best_gain > min_gain * heavy_load
        active[layers[~apply[:, 0]]] = False
        layer_index, heavy_index = np.nonzero(apply)
        if layer_index.size == 0:
            continue
        if 2 * layer_index.size > budget:
            relative_gain = (
                best_gain[layer_index, heavy_index] / heavy_load[layer_index, heavy_index]
            )
            keep = np.argsort(-relative_gain, kind="stable")[: budget // 2]
            layer_index, heavy_index = layer_index[keep], heavy_index[keep]
        best = flat_best[layer_index, heavy_index]
        per_partner = partner_slots.shape[2]
        own_slots = heavy_slots[layer_index, heavy_index, best // per_partner]
        partners = partner_slots[layer_index, heavy_index, best % per_partner]
        swap_layers = layers[layer_index]
        _swap(phy2log, slot_load, swap_layers, own_slots, partners)
        np.add.at(moves, swap_layers, 2)
        budget -= 2 * layer_index.size
        if budget < 2:
            break
    return moves


def shift_replicas(
    phy2log: np.ndarray,
    load: np.ndarray,
    num_gpus: int,
    *,
    min_gain: float,
    max_total_moves: int | None = None,
    donors: int = 8,
) -> np.ndarray:
    """Move replicas between experts (one slot changes its expert) while that lowers the heaviest GPU.

    A load shift can change how many replicas an expert deserves, which swaps cannot fix. Each step
    tries giving one more replica to an expert on the heaviest GPU, taken from one of the ``donors``
    experts whose load per replica stays lowest after losing one, in every slot of the donor on a GPU
    that does not hold the receiver yet; it applies the change with the lowest resulting heaviest GPU
    if that is below the current one by more than ``min_gain`` of it. In place.

    Args:
        phy2log: ``[L, R]`` modified in place. load: ``[L, E]``.
    Returns:
        ``[L]`` slots reassigned per layer.
    """
    num_layers, num_replicas = phy2log.shape
    num_experts = load.shape[1]
    slots_per_gpu = num_replicas // num_gpus
    slot_gpu = np.arange(num_replicas) // slots_per_gpu
    budget = np.iinfo(np.int64).max if max_total_moves is None else int(max_total_moves)
    moves = np.zeros(num_layers, dtype=np.int64)
    for layer in range(num_layers):
        weights = load[layer]
        experts = phy2log[layer]
        counts = np.bincount(experts, minlength=num_experts)
        while budget > 0:
            per_replica = weights / counts
            gpu_load = np.bincount(slot_gpu, weights=per_replica[experts], minlength=num_gpus)
            heavy = int(gpu_load.argmax())
            current = gpu_load[heavy]
            after_loss = np.where(counts >= 2, weights / np.maximum(counts - 1, 1), np.inf)
            best = (current * (1.0 - min_gain), -1, -1)
            for receiver in np.unique(experts[slot_gpu == heavy]):
                holds = np.zeros(num_gpus, dtype=bool)
                holds[slot_gpu[experts == receiver]] = True
                gain_per = weights[receiver] / (counts[receiver] + 1) - per_replica[receiver]
                base = (
                    gpu_load
                    + np.bincount(slot_gpu[experts == receiver], minlength=num_gpus) * gain_per
                )
                for donor in np.argsort(after_loss, kind="stable")[:donors]:
                    if donor == receiver or not np.isfinite(after_loss[donor]):
                        continue
                    loss_per = after_loss[donor] - per_replica[donor]
                    new = (
                        base
                        + np.bincount(slot_gpu[experts == donor], minlength=num_gpus) * loss_per
                    )
                    candidates = np.flatnonzero((experts == donor) & ~holds[slot_gpu])
                    if candidates.size == 0:
                        continue
                    order = np.argsort(-new, kind="stable")
                    top, second = order[0], order[1] if num_gpus > 1 else order[0]
                    cand_gpu = slot_gpu[candidates]
                    at_cand = (
                        new[cand_gpu]
                        - after_loss[donor]
                        + weights[receiver] / (counts[receiver] + 1)
                    )
                    others = np.where(cand_gpu == top, new[second], new[top])
                    resulting = np.maximum(at_cand, others)
                    pick = int(resulting.argmin())
                    if resulting[pick] < best[0]:
                        best = (resulting[pick], int(candidates[pick]), int(receiver))
            if best[1] < 0:
                break
            _, slot, receiver = best
            counts[experts[slot]] -= 1
            counts[receiver] += 1
            experts[slot] = receiver
            moves[layer] += 1
            budget -= 1
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
    num_layers, num_replicas = phy2log.shape
    num_experts = load.shape[1]
    slot_gpu = np.arange(num_replicas) // (num_replicas // num_gpus)
    slot_domain = slot_gpu // (gpus_per_domain or num_gpus)
    reassigned = 0
    for layer, slot in zip(*np.nonzero(duplicate_slots(phy2log, num_gpus)), strict=True):
        experts = phy2log[layer]
        counts = np.bincount(experts, minlength=num_experts)
        if (
            counts[experts[slot]] < 2
            or (experts[slot_gpu == slot_gpu[slot]] == experts[slot]).sum() < 2
        ):
            continue
        current = np.bincount(
            slot_gpu, weights=(load[layer] / counts)[experts], minlength=num_gpus
        ).max()
        on_gpu = np.zeros(num_experts, dtype=bool)
        on_gpu[experts[slot_gpu == slot_gpu[slot]]] = True
        in_domain = np.zeros(num_experts, dtype=bool)
        in_domain[experts[slot_domain == slot_domain[slot]]] = True
        candidates = np.flatnonzero(~on_gpu & in_domain)
        if candidates.size == 0:
            continue
        # Slot loads for every candidate at once: [candidates, R].
        trial = np.broadcast_to(experts, (candidates.size, num_replicas)).copy()
        trial[:, slot] = candidates
        trial_counts = counts[None, :].repeat(candidates.size, axis=0)
        trial_counts[:, experts[slot]] -= 1
        trial_counts[np.arange(candidates.size), candidates] += 1
        per_slot = np.take_along_axis(load[layer] / trial_counts, trial, axis=1)
        heaviest = per_slot.reshape(candidates.size, num_gpus, -1).sum(axis=2).max(axis=1)
        best = int(heaviest.argmin())
        if heaviest[best] <= current:
            phy2log[layer, slot] = candidates[best]
            reassigned += 1
    return reassigned
