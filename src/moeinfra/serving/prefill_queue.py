"""The prefill units as whole-step (chunked-prefill) queues, shared by the simulator and the TTFT
autoscaler so that both see the same first-token times.

A unit runs one step at a time, as vLLM's and SGLang's schedulers do: a step takes the prompts
waiting when it starts, in arrival order, up to a token budget (``ranks x tokens_per_gpu``; a longer
prompt is continued in the next steps), and lasts the longer of its step time (its busiest rank's
tokens pace the attention, shared experts, all-to-all and fixed costs; the routed experts see the
mean: :class:`~moeinfra.serving.unit_cost.PrefillCost`'s step curves) and the sum of its prompts'
work at the nominal batch. A prompt arriving mid-step waits for the step's end;
its first token comes at the end of the step holding its last chunk (plus the time outside the
units, ``request_overhead_s``). Each request is routed on arrival to the running unit with the
least outstanding work.

Sampling rule (docs/serving-model.md): a sampled request stands for ``scale`` real ones. One of
them arrives at the sampled instant; the other ``scale - 1`` arrive at an even rate until the
``SPREAD``-th sampled arrival after it, shared by the running units; on each unit they arrive as a
Poisson process, each a copy of a sample whose spread is running, and are served in the steps as
real prompts are (an idle unit starts a step when one arrives). At ``scale = 1`` this is exact.
The loop is compiled with numba (a day has ~1.5M sampled requests).
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: Sampled requests over which one sample's unseen prompts are spread: their rate is the
#: mean over this many samples (its noise ~1/sqrt(SPREAD), 4%).
SPREAD = 512

# per-unit state columns: the unseen prompts arrived and not yet served (count, tokens, work), the
# part of the next one arriving (count, tokens, work), the fleet's cumulative unseen arrivals at
# the last banking (count, tokens, work), all unseen tokens arrived and served so far (FIFO order
# between unseen and sampled prompts), the count at which the next unseen prompt arrives, draws,
# the largest unseen prompt waiting, the steps formed
_A_CNT, _A_TOK, _A_WORK, _F_CNT, _F_TOK, _F_WORK, _G_CNT, _G_TOK, _G_WORK = range(9)
_ARRIVED, _SERVED, _THR, _DRAWS, _A_MAX, _STEPS = range(9, 15)
# fleet state: cumulative unseen arrivals (count, tokens, work) at time _T and their rates; the
# next sample whose arrival (real or past the last) ends the spread of sample ``- SPREAD``; the first
# sample routed since the reset, how many spreads are running, and the samples routed
_CNT, _TOK, _WORK, _T, _R_CNT, _R_TOK, _R_WORK, _NEXT, _FIRST, _ACTIVE, _ROUTED = range(11)


@njit(cache=True)
def _uniform(seed, u, k):  # pragma: no cover
    """A uniform draw in (0, 1], the ``k``-th of unit ``u`` (splitmix64: the same whatever the
    order in which units advance)."""
    z = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
    z += np.uint64(u + 1) * np.uint64(0xBF58476D1CE4E5B9)
    z += np.uint64(k + 1) * np.uint64(0x94D049BB133111EB)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (float(z >> np.uint64(11)) + 1.0) / 9007199254740992.0


@njit(cache=True)
def _exponential(seed, u, k):  # pragma: no cover
    return -np.log(_uniform(seed, u, k))


@njit(cache=True)
def _quantile_at(p, table):  # pragma: no cover
    """The value at probability ``p`` of quantiles ``table`` taken at evenly spaced probabilities
    from 0 to 1 (linear between them)."""
    x = p * (table.size - 1)
    i = min(int(x), table.size - 2)
    return table[i] + (x - i) * (table[i + 1] - table[i])


@njit(cache=True)
def _fleet_at(fleet, t, out):  # pragma: no cover
    """The fleet's cumulative unseen arrivals (count, tokens, work) at ``t >= fleet[_T]``."""
    span = max(t - fleet[_T], 0.0)
    out[0] = fleet[_CNT] + max(fleet[_R_CNT], 0.0) * span
    out[1] = fleet[_TOK] + max(fleet[_R_TOK], 0.0) * span
    out[2] = fleet[_WORK] + max(fleet[_R_WORK], 0.0) * span


@njit(cache=True)
def _move_fleet(fleet, t, tmp):  # pragma: no cover
    _fleet_at(fleet, t, tmp)
    fleet[_CNT], fleet[_TOK], fleet[_WORK], fleet[_T] = tmp[0], tmp[1], tmp[2], t


@njit(cache=True)
def _bank(
    unit_state, u, fleet, t, units, seed, tmp, tokens, work, scale, ahead
):  # pragma: no cover
    """Add unit ``u``'s share of the unseen prompts arriving until ``t``: they arrive one at a
    time, a Poisson process at the share's rate, each a copy of a sample whose spread is running
    (drawn at random; the share's mean since the one before if none is found)."""
    _fleet_at(fleet, t, tmp)
    share = tmp  # the unit's share of what arrived since its last banking, in place
    for k in range(3):
        share[k] = (tmp[k] - unit_state[u, _G_CNT + k]) / units
        unit_state[u, _G_CNT + k] += share[k] * units
    lo = max(fleet[_FIRST], fleet[_NEXT] - SPREAD)
    count = fleet[_ROUTED] - lo
    while share[0] > 0.0 and unit_state[u, _F_CNT] + share[0] >= unit_state[u, _THR] - 1e-9:
        portion = min((unit_state[u, _THR] - unit_state[u, _F_CNT]) / share[0], 1.0)
        for k in range(3):
            part = share[k] * portion
            share[k] -= part
            unit_state[u, _F_CNT + k] += part
        size = unit_state[u, _F_TOK] / unit_state[u, _F_CNT]
        cost = unit_state[u, _F_WORK] / unit_state[u, _F_CNT]
        for attempt in range(8):
            if count < 1:
                break
            draw = _uniform(seed ^ 0x5BD1E995, u, 8 * unit_state[u, _DRAWS] + attempt)
            j = int(lo + min(np.floor(draw * count), count - 1))
            if ahead[j] >= 0.0:
                size, cost = tokens[j], work[j] / scale
                break
        unit_state[u, _A_CNT] += 1.0
        unit_state[u, _A_TOK] += size
        unit_state[u, _A_WORK] += cost
        unit_state[u, _A_MAX] = max(unit_state[u, _A_MAX], size)
        unit_state[u, _ARRIVED] += size
        unit_state[u, _F_CNT] = unit_state[u, _F_TOK] = unit_state[u, _F_WORK] = 0.0
        unit_state[u, _THR] = _exponential(seed, u, unit_state[u, _DRAWS])
        unit_state[u, _DRAWS] += 1.0
    for k in range(3):
        unit_state[u, _F_CNT + k] += share[k]


@njit(cache=True)
def _advance(
    u,
    until,
    units,
    slowdown,
    ranks,
    rank_budget,
    grid_tokens,
    grid_rank_s,
    grid_routed_s,
    jitter,
    overhead,
    seed,
    tokens_all,
    work_all,
    scale,
    fleet,
    unit_state,
    busy,
    head,
    queued_work,
    nxt,
    rem_tok,
    rem_work,
    ahead,
    done_idx,
    done_first,
    done_unit,
    n_done,
    spans,
    n_spans,
    tmp,
):  # pragma: no cover
    """Form unit ``u``'s steps that start before ``until`` (no later than the fleet's next
    change of rates); returns the updated ``(n_done, n_spans)``, or ``n_spans = -1`` when
    ``spans`` is full (call again with a larger one)."""
    running = u < units
    budget_tokens = ranks * rank_budget
    while True:
        start = max(busy[u], fleet[_T])
        if start >= until:
            return n_done, n_spans
        if running:
            _bank(unit_state, u, fleet, start, units, seed, tmp, tokens_all, work_all, scale, ahead)
        if head[u] < 0 and unit_state[u, _A_CNT] < 1e-9:
            # idle until the next unseen prompt arrives (or a sampled one is routed here)
            if not running or fleet[_R_CNT] <= 0.0:
                return n_done, n_spans
            start += (unit_state[u, _THR] - unit_state[u, _F_CNT]) * units / fleet[_R_CNT]
            if start >= until:
                return n_done, n_spans
            _bank(unit_state, u, fleet, start, units, seed, tmp, tokens_all, work_all, scale, ahead)
        if n_spans >= spans.shape[0]:
            return n_done, -1
        budget = budget_tokens
        tokens = work = biggest = 0.0
        j = head[u]
        first_done = n_done
        while budget > 1e-9:
            due = ahead[j] - unit_state[u, _SERVED] if j >= 0 else unit_state[u, _A_TOK]
            due = min(due, unit_state[u, _A_TOK])
            if due > 1e-9:  # unseen prompts that arrived before the next sampled one
                take = min(due, budget)
                frac = take / unit_state[u, _A_TOK]
                cnt = unit_state[u, _A_CNT] * frac
                work += unit_state[u, _A_WORK] * frac
                for k in range(3):
                    unit_state[u, _A_CNT + k] *= 1.0 - frac
                unit_state[u, _SERVED] += take
                tokens += take
                budget -= take
                if cnt > 0:
                    biggest = max(biggest, min(take, unit_state[u, _A_MAX]))
                if unit_state[u, _A_TOK] <= 1e-9:
                    unit_state[u, _A_MAX] = 0.0
                continue
            if j < 0:
                break
            take = min(rem_tok[j], budget)
            frac = take / rem_tok[j] if rem_tok[j] > 0 else 1.0
            part = rem_work[j] * frac
            work += part
            queued_work[u] -= part
            rem_work[j] -= part
            rem_tok[j] -= take
            tokens += take
            budget -= take
            biggest = max(biggest, take)
            if rem_tok[j] > 1e-9:
                break
            done_idx[n_done] = j
            done_unit[n_done] = u
            n_done += 1
            j = nxt[j]
            head[u] = j
        if tokens <= 0.0 and n_done == first_done:  # unseen prompts with nothing to compute
            work += unit_state[u, _A_WORK]
            unit_state[u, _A_CNT] = unit_state[u, _A_WORK] = 0.0
        mean = tokens / ranks
        busiest = min(rank_budget, max(mean, biggest))
        paced = np.interp(busiest, grid_tokens, grid_rank_s)
        step = max(paced + np.interp(mean, grid_tokens, grid_routed_s), work) * slowdown
        if jitter.size:  # this step's time / its modelled time, drawn from the measured spread
            step *= _quantile_at(_uniform(seed ^ 0x2545F491, u, unit_state[u, _STEPS]), jitter)
        unit_state[u, _STEPS] += 1.0
        end = start + step
        for k in range(first_done, n_done):
            done_first[k] = end + overhead
        spans[n_spans, 0] = u
        spans[n_spans, 1] = start
        spans[n_spans, 2] = end
        n_spans += 1
        busy[u] = end


@njit(cache=True)
def _spread(fleet, i, sign, arrival, tokens, work, scale, mean_gap, ahead):  # pragma: no cover
    """Start (``sign`` 1) or end (-1) sample ``i``'s unseen prompts: ``scale - 1`` copies of it
    arriving at an even rate until the ``SPREAD``-th sample after it (past the last sample, at
    the mean spacing)."""
    if i < fleet[_FIRST] or ahead[i] < 0.0:  # not routed since the reset, or refused
        return
    n = arrival.size
    j = i + SPREAD
    end = arrival[j] if j < n else arrival[n - 1] + (j - n + 1) * mean_gap
    unseen = scale - 1.0
    per_prompt = (1.0, tokens[i], work[i] / scale)
    if end - arrival[i] <= 0.0:  # all at once
        if sign > 0:
            for k in range(3):
                fleet[_CNT + k] += unseen * per_prompt[k]
        return
    fleet[_ACTIVE] += sign
    for k in range(3):
        # exactly none when none runs (float sums of opposite signs leave a residue)
        rate = fleet[_R_CNT + k] + sign * unseen * per_prompt[k] / (end - arrival[i])
        fleet[_R_CNT + k] = rate if fleet[_ACTIVE] > 0 else 0.0


@njit(cache=True)
def _run(
    lo,
    hi,
    units,
    started,
    slowdown,
    until,
    last,
    max_wait,
    scale,
    seed,
    arrival,
    work,
    tokens,
    mean_gap,
    ranks,
    rank_budget,
    grid_tokens,
    grid_rank_s,
    grid_routed_s,
    jitter,
    overhead,
    fleet,
    unit_state,
    busy,
    head,
    tail,
    queued_work,
    nxt,
    rem_tok,
    rem_work,
    ahead,
    done_idx,
    done_first,
    done_unit,
    refused,
    spans,
    counts,
):  # pragma: no cover
    """Route requests ``lo..hi-1`` (sorted by arrival) to the first ``units`` units and form the
    steps of the first ``started`` units (any that ever ran) that start before each arrival and
    before ``until``; when ``last``, end the spread of every sample routed
    first. ``counts`` = (next request to route, done, refused, spans) in and out; returns False
    when ``spans`` filled up first (call again)."""
    tmp = np.empty(3)
    n = arrival.size
    i, n_done, n_ref, n_spans = counts[0], counts[1], counts[2], counts[3]
    while True:
        # the next change of the fleet's rates: a routed arrival, or the end of a spread
        j = int(fleet[_NEXT])
        if i < hi:
            t, ends_spread = arrival[i], False
        elif j - SPREAD < i and (last or hi >= n):
            t = arrival[j] if j < n else arrival[n - 1] + (j - n + 1) * mean_gap
            ends_spread = True
        else:
            t, ends_spread = until, False
        t = min(t, until)
        for u in range(started):
            if busy[u] >= t or (u >= units and head[u] < 0 and unit_state[u, _A_CNT] < 1e-9):
                continue  # mid-step, or stopped with nothing to do: a call costs more than this
            n_done, got = _advance(
                u, t, units, slowdown, ranks, rank_budget, grid_tokens, grid_rank_s, grid_routed_s,
                jitter, overhead, seed, tokens, work, scale, fleet, unit_state, busy, head,
                queued_work, nxt, rem_tok, rem_work, ahead, done_idx, done_first, done_unit, n_done,
                spans, n_spans, tmp,
            )  # fmt: skip
            if got < 0:
                counts[0], counts[1], counts[2], counts[3] = i, n_done, n_ref, n_spans
                return False
            n_spans = got
        if t >= until:
            break
        _move_fleet(fleet, t, tmp)
        if ends_spread:
            _spread(fleet, j - SPREAD, -1.0, arrival, tokens, work, scale, mean_gap, ahead)
            fleet[_NEXT] = j + 1
            continue
        if fleet[_FIRST] < 0:
            fleet[_FIRST] = i
        if j <= i:
            _spread(fleet, i - SPREAD, -1.0, arrival, tokens, work, scale, mean_gap, ahead)
            fleet[_NEXT] = i + 1
        best, best_wait = -1, np.inf
        for u in range(units):
            wait = max(busy[u] - t, 0.0) + queued_work[u] + unit_state[u, _A_WORK]
            if wait < best_wait:
                best, best_wait = u, wait
        if best < 0 or best_wait > max_wait:
            refused[n_ref] = i
            n_ref += 1
            ahead[i] = -1.0
        else:
            _bank(unit_state, best, fleet, t, units, seed, tmp, tokens, work, scale, ahead)
            ahead[i] = unit_state[best, _ARRIVED]
            rem_tok[i], rem_work[i] = tokens[i], work[i] / scale
            queued_work[best] += rem_work[i]
            nxt[i] = -1
            if head[best] < 0:
                head[best] = i
            else:
                nxt[tail[best]] = i
            tail[best] = i
            _spread(fleet, i, 1.0, arrival, tokens, work, scale, mean_gap, ahead)
        i += 1
        fleet[_ROUTED] = i
    counts[0], counts[1], counts[2], counts[3] = i, n_done, n_ref, n_spans
    return True


class PrefillQueue:
    """The prefill units of a fleet as whole-step queues (module docstring).

    ``work_s``: ``[n]`` unit-seconds per sampled request at the nominal batch (``scale`` requests'
    worth); ``tokens``: ``[n]`` uncached prompt tokens of one request; a step takes
    ``step_rank_s`` at its busiest rank's tokens plus ``step_routed_s`` (default none) at the mean
    tokens per rank, both on the grid ``step_tokens``; ``ranks`` x
    ``rank_budget`` tokens per step; ``step_jitter``: quantiles (at evenly spaced probabilities
    from 0 to 1) of a step's time over its modelled time, drawn for every step (empty: each
    step takes its modelled time); ``request_overhead_s``: added to every first token; ``seed``:
    of the unseen prompts' arrival times and the steps' jitter.
    """

    def __init__(
        self,
        arrival_s: np.ndarray,
        work_s: np.ndarray,
        tokens: np.ndarray,
        *,
        step_tokens: np.ndarray,
        step_rank_s: np.ndarray,
        step_routed_s: np.ndarray | None = None,
        step_jitter=(),
        ranks: int,
        rank_budget: float,
        scale: float,
        max_units: int,
        request_overhead_s: float = 0.0,
        max_wait_s: float = np.inf,
        seed: int = 0,
    ) -> None:
        self.seed = int(seed)
        self.arrival = np.ascontiguousarray(arrival_s, dtype=np.float64)
        self.work = np.ascontiguousarray(work_s, dtype=np.float64)
        self.tokens = np.ascontiguousarray(tokens, dtype=np.float64)
        self.step_tokens = np.ascontiguousarray(step_tokens, dtype=np.float64)
        self.step_rank_s = np.ascontiguousarray(step_rank_s, dtype=np.float64)
        routed = np.zeros_like(self.step_rank_s) if step_routed_s is None else step_routed_s
        self.step_routed_s = np.ascontiguousarray(routed, dtype=np.float64)
        self.step_jitter = np.ascontiguousarray(step_jitter, dtype=np.float64)
        self.ranks, self.rank_budget = int(ranks), float(rank_budget)
        self.scale, self.max_wait_s = float(scale), float(max_wait_s)
        self.overhead = float(request_overhead_s)
        n = self.arrival.size
        self.mean_gap = float(self.arrival[-1] - self.arrival[0]) / max(n - 1, 1) if n else 0.0
        self.nxt = np.full(n, -1, dtype=np.int64)
        self.rem_tok, self.rem_work, self.ahead = np.zeros(n), np.zeros(n), np.zeros(n)
        self.busy = np.zeros(max_units)
        self.reset()

    def reset(self) -> None:
        """Empty every unit (to run another trial on the same requests)."""
        self.busy[:] = 0.0
        units = self.busy.size
        self.head = np.full(units, -1, dtype=np.int64)
        self.tail = np.full(units, -1, dtype=np.int64)
        self.queued_work = np.zeros(units)
        self.unit_state = np.zeros((units, 15))
        self.fleet = np.zeros(11)
        self.fleet[_T] = self.arrival[0] if self.arrival.size else 0.0
        self.fleet[_FIRST] = -1.0
        self.units = self.started = 0
        self.pending = 0

    def admit(
        self,
        lo: int,
        hi: int,
        units: int,
        slowdown: float = 1.0,
        until: float = np.inf,
        *,
        last: bool = False,
    ):
        """Route requests ``lo..hi-1`` to the first ``units`` units (in arrival order, after
        those routed before) and run every unit's steps that start before ``until`` (``inf``: all
        of them), their time ``slowdown`` times as long (units sharing a host's cores with busy
        decode units). Steps start only before the next request not yet routed arrives, unless
        ``last`` (no more requests will be routed: every step runs).

        Returns ``(done, unit, first_token_s, refused, spans)``: the requests whose first token
        is now known (any routed so far), their unit and first-token time, the indices refused
        for an expected wait over ``max_wait_s``, and the steps formed (``[k, 3]``: unit, start,
        end).
        """
        for u in range(self.units, units):  # started: they share the prompts arriving from now
            state = self.unit_state[u]
            state[_G_CNT : _G_WORK + 1] = self.fleet[_CNT : _WORK + 1]
            state[_F_CNT : _F_WORK + 1] = 0.0
            state[_THR] = _exponential(self.seed, u, state[_DRAWS])
            state[_DRAWS] += 1
        self.units = units
        self.started = max(self.started, units)
        if hi < self.arrival.size and not last:
            until = min(until, self.arrival[hi])
        cap = hi - lo + self.pending
        done_idx = np.empty(cap, dtype=np.int64)
        done_first = np.empty(cap)
        done_unit = np.empty(cap, dtype=np.int64)
        refused = np.empty(max(hi - lo, 0), dtype=np.int64)
        spans = np.empty((cap + 4 * self.busy.size, 3))
        counts = np.array([lo, 0, 0, 0], dtype=np.int64)
        while not _run(
            lo, hi, units, self.started, slowdown, until, last, self.max_wait_s, self.scale, self.seed,
            self.arrival,
            self.work, self.tokens, self.mean_gap, self.ranks, self.rank_budget,
            self.step_tokens, self.step_rank_s, self.step_routed_s, self.step_jitter, self.overhead,
            self.fleet, self.unit_state,
            self.busy, self.head, self.tail, self.queued_work, self.nxt, self.rem_tok,
            self.rem_work, self.ahead, done_idx, done_first, done_unit, refused, spans, counts,
        ):  # fmt: skip
            spans = np.concatenate([spans, np.empty_like(spans)])
        n_done, n_ref, n_spans = (int(c) for c in counts[1:])
        self.pending += (hi - lo) - n_ref - n_done
        order = np.argsort(done_idx[:n_done], kind="stable")
        return (
            done_idx[:n_done][order],
            done_unit[:n_done][order],
            done_first[:n_done][order],
            refused[:n_ref],
            spans[:n_spans],
        )
