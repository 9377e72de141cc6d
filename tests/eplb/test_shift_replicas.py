"""``shift_replicas`` (compiled) against the rule written out in numpy, one step at a time."""

from __future__ import annotations

import numpy as np
import pytest

from moeinfra.eplb.local_search import shift_replicas


def shift_replicas_by_hand(
    phy2log: np.ndarray,
    load: np.ndarray,
    num_gpus: int,
    *,
    min_gain: float,
    max_total_moves: int | None = None,
    donors: int = 8,
    gpus_per_domain: int | None = None,
) -> np.ndarray:
    """The rule of :func:`shift_replicas`, step by step in numpy (written from its docstring)."""
    num_layers, num_replicas = phy2log.shape
    num_experts = load.shape[1]
    slots_per_gpu = num_replicas // num_gpus
    slot_gpu = np.arange(num_replicas) // slots_per_gpu
    slot_domain = slot_gpu // (gpus_per_domain or num_gpus)
    moves = np.zeros(num_layers, dtype=np.int64)

    def best_step(layer: int) -> tuple[float, int, int]:
        """(relative gain, slot, receiver) of the layer's best reassignment; gain -1 if none."""
        weights, experts = load[layer], phy2log[layer]
        counts = np.bincount(experts, minlength=num_experts)
        per_replica = weights / counts
        gpu_load = np.bincount(slot_gpu, weights=per_replica[experts], minlength=num_gpus)
        heavy = int(gpu_load.argmax())
        current = gpu_load[heavy]
        after_loss = np.where(counts >= 2, weights / np.maximum(counts - 1, 1), np.inf)
        best = (current * (1.0 - min_gain), -1, -1)
        for receiver in np.unique(experts[slot_gpu == heavy]):
            holds = np.zeros(num_gpus, dtype=bool)
            holds[slot_gpu[experts == receiver]] = True
            home = np.zeros(num_replicas, dtype=bool)  # slots in a domain the receiver is in
            home[np.isin(slot_domain, slot_domain[experts == receiver])] = True
            gain_per = weights[receiver] / (counts[receiver] + 1) - per_replica[receiver]
            base = (
                gpu_load + np.bincount(slot_gpu[experts == receiver], minlength=num_gpus) * gain_per
            )
            for donor in np.argsort(after_loss, kind="stable")[:donors]:
                if donor == receiver or not np.isfinite(after_loss[donor]):
                    continue
                loss_per = after_loss[donor] - per_replica[donor]
                new = base + np.bincount(slot_gpu[experts == donor], minlength=num_gpus) * loss_per
                candidates = np.flatnonzero((experts == donor) & ~holds[slot_gpu] & home)
                if candidates.size == 0:
                    continue
                order = np.argsort(-new, kind="stable")
                top, second = order[0], order[1] if num_gpus > 1 else order[0]
                cand_gpu = slot_gpu[candidates]
                at_cand = (
                    new[cand_gpu] - after_loss[donor] + weights[receiver] / (counts[receiver] + 1)
                )
                others = np.where(cand_gpu == top, new[second], new[top])
                resulting = np.maximum(at_cand, others)
                pick = int(resulting.argmin())
                if resulting[pick] < best[0]:
                    best = (resulting[pick], int(candidates[pick]), int(receiver))
        if best[1] < 0:
            return -1.0, -1, -1
        return (current - best[0]) / current, best[1], best[2]

    def apply(layer: int, slot: int, receiver: int) -> None:
        phy2log[layer, slot] = receiver
        moves[layer] += 1

    if max_total_moves is None:  # layer after layer, each to its end
        for layer in range(num_layers):
            while (step := best_step(layer))[1] >= 0:
                apply(layer, step[1], step[2])
        return moves
    budget = int(max_total_moves)
    while budget > 0:  # the largest relative gain of all layers first (ties: the lower layer)
        steps = [best_step(layer) for layer in range(num_layers)]
        layer = int(np.argmax([g for g, _, _ in steps]))
        if steps[layer][1] < 0:
            break
        apply(layer, steps[layer][1], steps[layer][2])
        budget -= 1
    return moves


@pytest.mark.parametrize("seed", range(12))
def test_compiled_shift_replicas_is_the_rule(seed):
    rng = np.random.default_rng(seed)
    experts, gpus, slots_per_gpu, layers = 24, 8, 4, 3
    slots = gpus * slots_per_gpu
    load = rng.lognormal(0, 1.5, (layers, experts)) * 100
    phy2log = np.stack(
        [
            rng.permutation(np.r_[np.arange(experts), rng.integers(0, experts, slots - experts)])
            for _ in range(layers)
        ]
    )
    domain = (None, 4, 2)[seed % 3]
    budget = (None, 5)[seed % 2]
    mine, theirs = phy2log.copy(), phy2log.copy()
    moves = shift_replicas(
        mine, load, gpus, min_gain=1e-3, max_total_moves=budget, gpus_per_domain=domain
    )
    expect = shift_replicas_by_hand(
        theirs, load, gpus, min_gain=1e-3, max_total_moves=budget, gpus_per_domain=domain
    )
    np.testing.assert_array_equal(moves, expect)
    np.testing.assert_array_equal(mine, theirs)
    assert expect.sum() > 0 or seed % 2  # the cases move replicas
