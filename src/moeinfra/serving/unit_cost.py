"""What each request costs a unit, from the performance model and the in-unit balancers.

Shared by the simulator (which queues this work) and the autoscaler (which sizes units for it),
so both see the same service times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeinfra.serving.balancers import (
    DecodeLoadBalancer,
    PrefillLoadBalancer,
    RoundRobin,
    decode_imbalance,
)
from moeinfra.serving.perfmodel import INDEXER, PerfModel
from moeinfra.serving.prefill_queue import PrefillQueue
from moeinfra.serving.workload import Workload

#: In-unit DP-rank balancers: this package's (``"deepseek"``) or round robin / least requests.
BALANCERS = ("deepseek", "baseline")


@dataclass(frozen=True)
class PrefillCost:
    """Per request of a workload, on one prefill unit (real scale: one request, not a sample).

    ``work_s``: unit-seconds the request occupies the unit at its nominal batch (its share of the
    uncached tokens, its attention cost, the slowest DP rank). ``min_latency_s``: the step of its own
    tokens alone plus the time outside the units (``Efficiency.request_overhead_s``), the fastest
    its first token can come. ``imbalance``: DP-rank imbalance factors. ``tokens``: uncached prompt
    tokens. A step's time at ``step_tokens`` tokens per rank (up to ``rank_budget``, the unit's
    ``tokens_per_gpu``, on each of ``ranks``): ``step_rank_s`` at its busiest rank's tokens (that
    rank's attention, shared experts, all-to-all, overheads) plus ``step_routed_s`` at the mean
    (the routed experts see every rank's tokens); ``step_jitter``: the spread of step times
    (``Efficiency.prefill_step_jitter``).
    """

    work_s: np.ndarray
    min_latency_s: np.ndarray
    seconds_per_token: float
    attn_share: float
    imbalance: dict
    tokens: np.ndarray
    step_tokens: np.ndarray
    step_rank_s: np.ndarray
    step_routed_s: np.ndarray
    ranks: int
    rank_budget: float
    request_overhead_s: float
    step_jitter: tuple[float, ...] = ()

    def queue(
        self, workload: Workload, max_units: int, max_wait_s: float = np.inf, seed: int = 0
    ) -> PrefillQueue:
        """The whole-step queue of up to ``max_units`` units for ``workload``'s requests."""
        return PrefillQueue(
            workload.arrival_s,
            self.work_s * workload.scale,
            self.tokens,
            step_tokens=self.step_tokens,
            step_rank_s=self.step_rank_s,
            step_routed_s=self.step_routed_s,
            step_jitter=self.step_jitter,
            ranks=self.ranks,
            rank_budget=self.rank_budget,
            scale=workload.scale,
            max_units=max_units,
            request_overhead_s=self.request_overhead_s,
            max_wait_s=max_wait_s,
            seed=seed,
        )


def prefill_cost(
    prefill: PerfModel, decode: PerfModel, workload: Workload, balancer: str = "deepseek"
) -> PrefillCost:
    """Service time of every request of ``workload`` on a ``prefill`` unit (``balancer``:
    ``"deepseek"`` or ``"baseline"`` inside the unit; ``decode`` supplies the decode DP factors)."""
    n = workload.size
    inputs_sum = float(workload.input_tokens.sum(dtype=np.float64))
    cached_sum = float(workload.cached_tokens.sum(dtype=np.float64))
    mean_in = inputs_sum / n if n else 4096.0
    hit = cached_sum / max(inputs_sum, 1.0) if n else 0.0
    s_per_token = prefill.prefill_seconds_per_token(hit, mean_in)
    nominal = prefill.prefill_breakdown(
        cached_per_token=hit / max(1 - hit, 1e-6),
        attn_keys_per_token=mean_in * hit + mean_in * (1 - hit) / 2,
        prompt_len=max(mean_in * (1 - hit), 1.0),
    )
    # the part of a step that grows with the keys a token attends to (sparse attention: the
    # indexer's logits grow with them too)
    attention = nominal.parts["core_attn"].sum()
    if INDEXER in nominal.parts:
        attention = attention + nominal.parts[INDEXER].sum()
    attn_share = float(attention / nominal.compute.sum())
    imb = dp_imbalance(prefill, decode, workload, balancer, attn_share)
    chunks = [(lo, min(lo + CHUNK, n)) for lo in range(0, n, CHUNK)]
    weighted = 0.0
    for lo, hi in chunks:
        computed, keys = _computed_and_keys(workload, lo, hi)
        weighted += float((computed * keys).sum())
    mean_keys = weighted / max(inputs_sum - cached_sum, 1.0) if n else 1.0
    sparse = prefill.model.sparse
    mean_weight = float(prefill.prefill_attention_weight(max(mean_keys, 1.0)))
    grid = np.geomspace(64, prefill.dep.tokens_per_gpu, 24)
    steps = [prefill.prefill_breakdown(tokens_per_gpu=g, prompt_len=g) for g in grid]
    grid_s = np.array([b.step_s for b in steps])
    # the routed experts see every rank's tokens (the mean); the rest of a step, its rank's
    routed_s = np.array([b.layer.sum() * b.parts["routed"].sum() / b.compute.sum() for b in steps])
    work, min_latency, tokens = np.empty(n), np.empty(n), np.empty(n)
    for lo, hi in chunks:  # a chunk at a time: a day's requests never hold float temporaries
        computed, keys = _computed_and_keys(workload, lo, hi)
        tokens[lo:hi] = computed
        # dense attention grows with the keys; sparse attention's selected keys stop at index_topk
        # while its indexer keeps growing: the model's own curve
        grows = (
            prefill.prefill_attention_weight(keys) / mean_weight
            if sparse
            else keys / max(mean_keys, 1.0)
        )
        part = s_per_token * computed * ((1 - attn_share) + attn_share * grows)
        part *= imb["prefill"]
        work[lo:hi] = part
        per_rank = np.minimum(computed, prefill.dep.tokens_per_gpu)
        part = np.interp(per_rank, grid, grid_s) * np.maximum(
            1.0, computed / (prefill.dep.tokens_per_gpu * prefill.gpus)
        )
        part += prefill.eff.request_overhead_s
        min_latency[lo:hi] = part
    return PrefillCost(
        work,
        min_latency,
        s_per_token,
        attn_share,
        imb,
        tokens,
        grid,
        grid_s - routed_s,
        routed_s,
        prefill.gpus,
        float(prefill.dep.tokens_per_gpu),
        prefill.eff.request_overhead_s,
        prefill.eff.prefill_step_jitter,
    )


#: Requests per chunk of :func:`prefill_cost`'s per-request arithmetic.
CHUNK = 1 << 18


def _computed_and_keys(workload: Workload, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Uncached tokens of requests ``lo..hi-1`` and the mean keys each attends to (the cached
    prefix plus the causal half of its own part)."""
    cached = workload.cached_tokens[lo:hi].astype(np.float64)
    computed = workload.input_tokens[lo:hi] - cached
    return computed, cached + computed / 2


def dp_imbalance(
    prefill: PerfModel, decode: PerfModel, workload: Workload, balancer: str, attn_share: float
) -> dict:
    """Slowest DP rank / mean inside one unit, from the balancers on a sample of the workload.

    Prefill: a step's worth of prompts (ranks x tokens_per_gpu uncached tokens); a rank's cost is
    its token share of the linear work plus its attention share of the core-attention work.
    Decode: 64 requests per rank with KV = prompt + half the output; KV and request-count ratios.
    """
    if workload.size == 0:
        return {"prefill": 1.0, "decode_kv": 1.0, "decode_requests": 1.0}
    rng = np.random.default_rng(1)
    want = prefill.gpus * prefill.dep.tokens_per_gpu
    mean_computed = float((workload.input_tokens - workload.cached_tokens).mean())
    k = max(1, int(want / max(mean_computed, 1.0)))
    pick = rng.choice(workload.size, k, replace=True)
    prefill_lb = (
        PrefillLoadBalancer(prefill.gpus, max(prefill.dep.tokens_per_gpu // 4, 1))
        if balancer == "deepseek"
        else RoundRobin(prefill.gpus)
    )
    placed = prefill_lb.assign(workload.input_tokens[pick], workload.cached_tokens[pick])
    tokens = placed.rank_tokens / max(placed.rank_tokens.mean(), 1e-300)
    attn = placed.rank_attention / max(placed.rank_attention.mean(), 1e-300)
    rank_cost = (1 - attn_share) * tokens + attn_share * attn
    m = decode.gpus * 64
    pick = rng.choice(workload.size, m, replace=True)
    kv = workload.input_tokens[pick] + workload.output_tokens[pick] / 2
    decode_lb = (
        DecodeLoadBalancer(decode.gpus) if balancer == "deepseek" else RoundRobin(decode.gpus)
    )
    d = decode_imbalance(decode_lb.assign_decode(kv), kv, decode.gpus)
    return {
        "prefill": float(max(rank_cost.max() / rank_cost.mean(), 1.0)),
        "decode_kv": max(d["kv"], 1.0),
        "decode_requests": max(d["requests"], 1.0),
        "prefill_detail": placed.imbalance(),
    }
