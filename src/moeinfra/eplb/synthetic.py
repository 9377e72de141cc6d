"""Seeded synthetic expert loads with the skew seen in MoE serving, for tests, benchmarks and demos."""

from __future__ import annotations

import numpy as np

from moeinfra.errors import InputError

KINDS = ("lognormal", "zipf", "uniform")


def synthetic_load(
    kind: str,
    num_layers: int,
    num_experts: int,
    *,
    tokens: int = 65_536,
    experts_per_token: int = 8,
    skew: float | None = None,
    seed: int = 0,
) -> np.ndarray:
    """``[L, E]`` token counts per expert (float64, integral values) summing to ``tokens * experts_per_token``.

    * ``lognormal``: expert popularity ``exp(N(0, skew))``, default ``skew = 1.0``.
    * ``zipf``: popularity ``rank ** -skew`` over a random expert order per layer, default ``skew = 1.0``.
    * ``uniform``: every expert equally popular.

    Counts are a multinomial draw from the popularities, so they carry sampling noise like real counts.
    """
    if kind not in KINDS:
        raise InputError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        popularity = rng.lognormal(0.0, 1.0 if skew is None else skew, (num_layers, num_experts))
    elif kind == "zipf":
        ranks = np.arange(1, num_experts + 1, dtype=np.float64) ** -(1.0 if skew is None else skew)
        popularity = np.stack([rng.permutation(ranks) for _ in range(num_layers)])
    else:
        popularity = np.ones((num_layers, num_experts))
    probabilities = popularity / popularity.sum(axis=1, keepdims=True)
    return np.stack(
        [rng.multinomial(tokens * experts_per_token, row) for row in probabilities]
    ).astype(np.float64)


def perturb(load: np.ndarray, relative_noise: float, seed: int = 0) -> np.ndarray:
    """``load`` times independent lognormal noise of the given relative size (e.g. 0.02 = 2%)."""
    rng = np.random.default_rng(seed)
    return load * rng.lognormal(0.0, relative_noise, load.shape)
