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
    """The rule of :func:`shift_replicas`, step by step in numpy (its earlier implementation)."""
    num_layers, num_replicas = phy2log.shape
    num_experts = load.shape[1]
    slots_per_gpu = num_replicas // num_gpus
    slot_gpu = np.arange(num_replicas) // slots_per_gpu
    slot_domain = slot_gpu // (gpus_per_domain or num_gpus)
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
                home = np.zeros(num_replicas, dtype=bool)  # slots in a domain the receiver is in
                home[np.isin(slot_domain, slot_domain[experts == receiver])] = True
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
                    candidates = np.flatnonzero((experts == donor) & ~holds[slot_gpu] & home)
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
