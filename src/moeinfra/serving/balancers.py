"""Load-balancing policies of a prefill/decode-disaggregated service, usable outside the simulator.

* :class:`PrefillLoadBalancer` — requests (or pieces of long ones) to the DP ranks of a prefill unit,
  balancing core-attention cost and input tokens; each rank's batch split into two micro-batches of
  equal attention cost.
* :class:`DecodeLoadBalancer` — requests to the DP ranks of a decode unit, balancing KV-cache usage
  and request count.
* Baselines :class:`RoundRobin` and :class:`LeastRequests`.
* :func:`fill_least_loaded` — the vectorised unit-level form the simulator's decode side uses
  (water-filling).

The expert-parallel balancer is :func:`moeinfra.eplb.rebalance`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
from numba import njit

from moeinfra.errors import InputError


def attention_cost(computed: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """Core-attention work of a prompt piece, in query-key pairs: ``computed x (cached + computed/2)``."""
    computed = np.asarray(computed, dtype=np.float64)
    return computed * (np.asarray(cached, dtype=np.float64) + computed / 2.0)


@dataclass(frozen=True)
class PrefillAssignment:
    """Pieces of requests placed on ranks (all arrays ``[pieces]``).

    request: index of the request; offset/length: which uncached tokens of it; rank; micro_batch
    (0/1); attention: query-key pairs of the piece. ``rank_attention``/``rank_tokens``: ``[ranks]``.
    """

    request: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    rank: np.ndarray
    micro_batch: np.ndarray
    attention: np.ndarray
    rank_attention: np.ndarray
    rank_tokens: np.ndarray

    def imbalance(self) -> dict[str, float]:
        """max/mean per rank of attention and tokens, and of the two micro-batches' attention."""
        mb = np.zeros((self.rank_attention.size, 2))
        np.add.at(mb, (self.rank, self.micro_batch), self.attention)
        mean_a = max(self.rank_attention.mean(), 1e-300)
        mean_t = max(self.rank_tokens.mean(), 1e-300)
        heavier = mb.max(axis=1)
        return {
            "attention": float(self.rank_attention.max() / mean_a),
            "tokens": float(self.rank_tokens.max() / mean_t),
            "micro_batch": float((2 * heavier).sum() / max(mb.sum(), 1e-300)),
        }


def _pieces(inputs: np.ndarray, cached: np.ndarray, max_piece: int):
    computed = inputs - cached
    n_pieces = np.maximum(1, -(-computed // max_piece))
    request = np.repeat(np.arange(inputs.size), n_pieces)
    first = np.cumsum(n_pieces) - n_pieces
    k = np.arange(request.size) - np.repeat(first, n_pieces)
    offset = k * max_piece
    length = np.minimum(max_piece, computed[request] - offset)
    attn = attention_cost(length, cached[request] + offset)
    return request, offset, length, attn


def _split_micro_batches(request, offset, length, rank, cached, ranks):
    """Split each rank's pieces into two micro-batches of equal attention cost.

    A rank's pieces are laid end to end; the piece that straddles half the rank's attention is cut
    at the token where the first micro-batch reaches exactly half (x tokens of a piece with ``c``
    tokens before it cost ``x (c + x / 2)``, so ``x = -c + sqrt(c^2 + 2 need)``).
    """
    out = {k: [] for k in ("request", "offset", "length", "rank", "micro")}
    before = cached[request] + offset
    attn = attention_cost(length, before)
    order = np.lexsort((offset, request, rank))
    bounds = np.searchsorted(rank[order], np.arange(ranks + 1))
    for r in range(ranks):
        idx = order[bounds[r] : bounds[r + 1]]
        if idx.size == 0:
            continue
        cum = np.cumsum(attn[idx])
        half = cum[-1] / 2
        k = int(np.searchsorted(cum, half))  # piece that straddles the half
        need = half - (cum[k - 1] if k else 0.0)
        c, n = float(before[idx[k]]), int(length[idx[k]])
        x = int(round(-c + np.sqrt(c * c + 2 * need)))
        x = min(max(x, 0), n)
        parts = [(idx[:k], None, 0), (idx[k + 1 :], None, 1)]
        for group, _, micro in parts:
            out["request"].append(request[group])
            out["offset"].append(offset[group])
            out["length"].append(length[group])
            out["rank"].append(np.full(group.size, r))
            out["micro"].append(np.full(group.size, micro))
        for lo, hi, micro in ((0, x, 0), (x, n, 1)):
            if hi > lo:
                out["request"].append(request[idx[k : k + 1]])
                out["offset"].append(offset[idx[k : k + 1]] + lo)
                out["length"].append(np.array([hi - lo]))
                out["rank"].append(np.array([r]))
                out["micro"].append(np.array([micro]))
    joined = {k: np.concatenate(v).astype(np.int64) for k, v in out.items()}
    return joined


class PrefillLoadBalancer:
    """Balance core-attention cost and input tokens over ``num_ranks`` DP ranks of a prefill unit.

    Prompts longer than ``max_piece_tokens`` uncached tokens are cut into pieces (a later piece
    attends to the earlier ones, so its attention cost is higher). Pieces go heaviest first to the
    rank with the smallest ``attention/mean + tokens/mean`` score; then each rank's batch is cut
    into two micro-batches of equal attention cost (one piece may be split between them).
    """

    def __init__(self, num_ranks: int, max_piece_tokens: int = 4096) -> None:
        if num_ranks < 1 or max_piece_tokens < 1:
            raise InputError(
                f"num_ranks={num_ranks} and max_piece_tokens={max_piece_tokens} must be >= 1"
            )
        self.num_ranks, self.max_piece = num_ranks, max_piece_tokens

    def assign(
        self, input_tokens, cached_tokens, rank_attention=None, rank_tokens=None
    ) -> PrefillAssignment:
        """Place ``[n]`` requests (prompt lengths and cache-hit prefixes) on the ranks.

        ``rank_attention``/``rank_tokens`` ``[ranks]``: work the ranks already have queued (a live
        server's state; default none). The returned per-rank totals count only the new pieces."""
        inputs, cached = _check_prompts(input_tokens, cached_tokens)
        request, offset, length, attn = _pieces(inputs, cached, self.max_piece)
        base_a, base_t = (
            np.zeros(self.num_ranks) if x is None else np.asarray(x, dtype=np.float64)
            for x in (rank_attention, rank_tokens)
        )
        if base_a.shape != (self.num_ranks,) or base_t.shape != (self.num_ranks,):
            raise InputError(f"rank_attention and rank_tokens must have shape ({self.num_ranks},)")
        mean_a = max((attn.sum() + base_a.sum()) / self.num_ranks, 1e-300)
        mean_t = max((length.sum() + base_t.sum()) / self.num_ranks, 1e-300)
        rank = np.empty(request.size, dtype=np.int64)
        heap = [
            (base_a[r] / mean_a + base_t[r] / mean_t, r, base_a[r], base_t[r])
            for r in range(self.num_ranks)
        ]
        heapq.heapify(heap)
        order = np.argsort(-(attn / mean_a + length / mean_t), kind="stable")
        for i in order:
            _, r, a, t = heapq.heappop(heap)
            rank[i] = r
            a, t = a + attn[i], t + length[i]
            heapq.heappush(heap, (a / mean_a + t / mean_t, r, a, t))
        return _prefill_result(request, offset, length, rank, cached, self.num_ranks)


class RoundRobin:
    """Baseline: request ``i`` to rank ``i mod num_ranks`` (whole prompts, alternating micro-batches)."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise InputError(f"num_ranks={num_ranks} must be >= 1")
        self.num_ranks = num_ranks

    def assign(self, input_tokens, cached_tokens) -> PrefillAssignment:
        inputs, cached = _check_prompts(input_tokens, cached_tokens)
        n = inputs.size
        request = np.arange(n)
        length = inputs - cached
        rank = request % self.num_ranks
        attn = attention_cost(length, cached)
        micro = (request // self.num_ranks) % 2
        rank_attention = np.bincount(rank, attn, self.num_ranks)
        rank_tokens = np.bincount(rank, length.astype(np.float64), self.num_ranks)
        return PrefillAssignment(
            request, np.zeros(n, np.int64), length, rank, micro, attn, rank_attention, rank_tokens
        )

    def assign_decode(self, kv_tokens, rank_kv=None, rank_requests=None) -> np.ndarray:
        """Decode form: request ``i`` to rank ``i mod num_ranks``."""
        return np.arange(np.asarray(kv_tokens).size) % self.num_ranks


def _prefill_result(request, offset, length, rank, cached, ranks) -> PrefillAssignment:
    j = _split_micro_batches(request, offset, length, rank, cached, ranks)
    attn = attention_cost(j["length"], cached[j["request"]] + j["offset"])
    return PrefillAssignment(
        j["request"],
        j["offset"],
        j["length"],
        j["rank"],
        j["micro"],
        attn,
        np.bincount(j["rank"], attn, ranks),
        np.bincount(j["rank"], j["length"].astype(np.float64), ranks),
    )


def _check_prompts(input_tokens, cached_tokens) -> tuple[np.ndarray, np.ndarray]:
    inputs = np.asarray(input_tokens, dtype=np.int64)
    cached = np.asarray(cached_tokens, dtype=np.int64)
    if inputs.shape != cached.shape or inputs.ndim != 1:
        raise InputError("input_tokens and cached_tokens must be 1-D arrays of the same length")
    if inputs.size and (inputs.min() < 1 or cached.min() < 0 or np.any(cached >= inputs)):
        raise InputError("need input_tokens >= 1 and 0 <= cached_tokens < input_tokens")
    return inputs, cached


class DecodeLoadBalancer:
    """Balance KV-cache usage and request count over ``num_ranks`` DP ranks of a decode unit.

    Each new request (given its KV length) goes to the rank with the smallest
    ``kv/kv_mean + requests/requests_mean`` after adding it, largest requests first.
    """

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise InputError(f"num_ranks={num_ranks} must be >= 1")
        self.num_ranks = num_ranks

    def assign_decode(self, kv_tokens, rank_kv=None, rank_requests=None) -> np.ndarray:
        """Rank ``[n]`` for new requests of KV length ``kv_tokens [n]``, given the ranks' current
        KV tokens and request counts (``[ranks]``, default empty)."""
        kv, rank_kv, rank_requests = _check_decode(
            kv_tokens, rank_kv, rank_requests, self.num_ranks
        )
        mean_kv = max((rank_kv.sum() + kv.sum()) / self.num_ranks, 1e-300)
        mean_n = max((rank_requests.sum() + kv.size) / self.num_ranks, 1e-300)
        heap = [
            (rank_kv[r] / mean_kv + rank_requests[r] / mean_n, r, rank_kv[r], rank_requests[r])
            for r in range(self.num_ranks)
        ]
        heapq.heapify(heap)
        out = np.empty(kv.size, dtype=np.int64)
        for i in np.argsort(-kv, kind="stable"):
            _, r, k, c = heapq.heappop(heap)
            out[i] = r
            k, c = k + kv[i], c + 1
            heapq.heappush(heap, (k / mean_kv + c / mean_n, r, k, c))
        return out


class LeastRequests:
    """Baseline: each request to the rank with the fewest requests (lowest index on ties)."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise InputError(f"num_ranks={num_ranks} must be >= 1")
        self.num_ranks = num_ranks

    def assign_decode(self, kv_tokens, rank_kv=None, rank_requests=None) -> np.ndarray:
        kv, _, rank_requests = _check_decode(kv_tokens, rank_kv, rank_requests, self.num_ranks)
        heap = [(int(c), r) for r, c in enumerate(rank_requests)]
        heapq.heapify(heap)
        out = np.empty(kv.size, dtype=np.int64)
        for i in range(kv.size):
            c, r = heapq.heappop(heap)
            out[i] = r
            heapq.heappush(heap, (c + 1, r))
        return out


def _check_decode(kv_tokens, rank_kv, rank_requests, ranks):
    kv = np.asarray(kv_tokens, dtype=np.float64)
    if kv.ndim != 1 or (kv.size and kv.min() < 0):
        raise InputError("kv_tokens must be a 1-D array of values >= 0")
    rank_kv = np.zeros(ranks) if rank_kv is None else np.asarray(rank_kv, dtype=np.float64)
    rank_requests = (
        np.zeros(ranks) if rank_requests is None else np.asarray(rank_requests, dtype=np.float64)
    )
    if rank_kv.shape != (ranks,) or rank_requests.shape != (ranks,):
        raise InputError(f"rank_kv and rank_requests must have shape ({ranks},)")
    return kv, rank_kv, rank_requests


def decode_imbalance(assigned_rank: np.ndarray, kv_tokens: np.ndarray, num_ranks: int) -> dict:
    """max/mean per rank of KV tokens and of request counts."""
    kv = np.bincount(assigned_rank, kv_tokens, num_ranks)
    n = np.bincount(assigned_rank, minlength=num_ranks)
    return {
        "kv": float(kv.max() / max(kv.mean(), 1e-300)),
        "requests": float(n.max() / max(n.mean(), 1e-300)),
    }


def fill_least_loaded(levels: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Assign items (in order) to bins by water-filling: ``[n]`` bin per item.

    ``levels [bins]``: current load of each bin (``inf`` = closed). ``costs [n] >= 0``. The items'
    costs fill the lowest bins up to a common level, so the least-loaded bin always gets work first
    — the vectorised form of "send to the least loaded" for a burst of requests.
    """
    levels = np.asarray(levels, dtype=np.float64)
    costs = np.asarray(costs, dtype=np.float64)
    open_bins = np.flatnonzero(np.isfinite(levels))
    if open_bins.size == 0:
        raise InputError("fill_least_loaded needs at least one open bin")
    if costs.size == 0:
        return np.zeros(0, dtype=np.int64)
    return water_fill(levels, costs)


@njit(cache=True)
def water_fill(levels, costs):  # pragma: no cover
    """:func:`fill_least_loaded` compiled, its checks left to the caller (the simulator calls it
    from compiled code)."""
    open_bins = np.flatnonzero(np.isfinite(levels))
    order = open_bins[np.argsort(levels[open_bins], kind="mergesort")]
    sorted_levels = levels[order]
    total = costs.sum()
    # level L with sum(max(0, L - b)) = total: the fewest lowest bins it covers
    prefix = np.cumsum(sorted_levels)
    j = 0
    for k in range(order.size):
        following = sorted_levels[k + 1] if k + 1 < order.size else np.inf
        if (total + prefix[k]) / (k + 1) <= following:
            j = k
            break
    level = (total + prefix[j]) / (j + 1)
    room = np.maximum(level - sorted_levels[: j + 1], 0.0)
    if room.sum() <= 0:
        return np.full(costs.size, order[0], dtype=np.int64)
    bounds = np.cumsum(room)
    mid = np.cumsum(costs) - costs / 2
    slot = np.minimum(np.searchsorted(bounds, mid * (bounds[-1] / total), side="right"), j)
    return order[slot]
