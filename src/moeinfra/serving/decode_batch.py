"""The simulator's per-request decode loops, compiled with numba. Every tick goes through every
running request three times (admission, the batch's load, the advance); as numpy expressions
that was ~70 array operations per tick on ~1,300 requests in the default day, more than half of
the simulator's time (docs/benchmarks.md).

Each function computes what the numpy expressions it replaced did, in the same order (on five
scenarios the figures agree to 4e-16); :func:`moeinfra.serving.simulate.simulate` documents the
model.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeinfra.serving.balancers import water_fill


@njit(cache=True)
def batch_load(
    a_idx, a_unit, a_done, a_from, inputs, outputs, last_step, t1, tick_s, per_step, units
):  # pragma: no cover
    """Per running request: seconds it can run this tick (``run_s``) and output tokens left
    (``remaining``); per unit: the requests in its batch (``count``, each counted for the share
    of the tick before it finishes, estimated with the unit's previous step time) and their KV
    tokens (``kv_tokens``, weighted the same way)."""
    n = a_idx.size
    run_s, remaining = np.empty(n), np.empty(n)
    count, kv_tokens = np.zeros(units), np.zeros(units)
    for i in range(n):
        r, u = a_idx[i], a_unit[i]
        run_s[i] = t1 - a_from[i]
        remaining[i] = outputs[r] - a_done[i]
        occupancy = min(run_s[i], remaining[i] / per_step * last_step[u]) / tick_s
        count[u] += occupancy
        kv_tokens[u] += occupancy * (inputs[r] + a_done[i])
    return run_s, remaining, count, kv_tokens


@njit(cache=True)
def advance_batch(
    a_idx,
    a_unit,
    a_done,
    a_from,
    run_s,
    remaining,
    held,
    step,
    per_step,
    t1,
    inputs,
    outputs,
    first_token,
    finish_t,
    tpot,
    status,
    completed,
    units,
):  # pragma: no cover
    """Advance every running request by the tokens its unit's ``step`` allows in ``run_s - held``
    seconds; a request that finishes gets its finish time, mean time per output token after the
    first and status ``completed``, and leaves the running set, which is compacted in place
    (the others run on from ``t1``).

    Returns ``(running, produced, whole, kv_weighted, unit_produced, unit_started)``: how many
    still run (the first entries of the ``a_*`` arrays), the tokens produced, the whole tokens
    completed (each request's tokens done rounded down, before and after: summed over ticks, a
    request's whole tokens exactly), their sum of KV length (at each token's midpoint), and per
    unit the tokens produced and the requests that produced at least one."""
    produced_sum = kv_weighted = 0.0
    whole = 0
    unit_produced, unit_started = np.zeros(units), np.zeros(units)
    k = 0
    for i in range(a_idx.size):
        r, u = a_idx[i], a_unit[i]
        gain = max(run_s[i] - held[i], 0.0) / step[u] * per_step
        produced = min(gain, remaining[i])
        produced_sum += produced
        unit_produced[u] += produced
        if produced > 0:
            unit_started[u] += 1.0
        kv_weighted += produced * (inputs[r] + a_done[i] + produced / 2)
        before = int(np.floor(a_done[i]))
        if gain >= remaining[i]:
            whole += outputs[r] - before
            left = remaining[i]  # 0 for a request whose only token came from prefill
            finish_t[r] = a_from[i] + held[i] + left / per_step * (step[u] if left > 0 else 0.0)
            status[r] = completed
            if outputs[r] > 1:
                tpot[r] = (finish_t[r] - first_token[r]) / (outputs[r] - 1)
        else:
            done = a_done[i] + produced
            whole += int(np.floor(done)) - before
            a_idx[k], a_unit[k], a_done[k], a_from[k] = r, u, done, t1
            k += 1
    return k, produced_sum, whole, kv_weighted, unit_produced, unit_started


@njit(cache=True)
def admit_ready(
    pend,
    ready,
    t0,
    t1,
    a_idx,
    a_unit,
    a_done,
    a_from,
    inputs,
    outputs,
    home,
    d_units,
    units,
    scale,
    kv_cap_unit,
    batch_cap_unit,
    max_wait_s,
    status,
    reason,
    rejected,
):  # pragma: no cover
    """Admit the waiting requests ``pend`` whose KV cache is ready (``ready < t1``), earliest
    first, each to the least KV-loaded of the ``d_units >= 1`` running units (water-filling; with
    a non-empty ``home``, a colocated request's own unit while it runs) while the unit's KV cache
    (``kv_cap_unit``) and batch (``batch_cap_unit``) hold it with the ones admitted before; a
    request left waiting over ``max_wait_s`` is rejected (status ``rejected``, reason 1).

    Returns the running set with the admitted appended (``a_idx, a_unit, a_done, a_from``, each
    starting at ``max(ready, t0)`` with one token done) and the requests still waiting, in order."""
    is_ready = ready < t1
    positions = np.flatnonzero(is_ready)
    if positions.size == 0:
        return a_idx, a_unit, a_done, a_from, pend
    positions = positions[np.argsort(ready[positions], kind="mergesort")]
    cand = pend[positions]
    kv_now, running = np.zeros(units), np.zeros(units)
    for i in range(a_idx.size):
        kv_now[a_unit[i]] += inputs[a_idx[i]] + a_done[i]
        running[a_unit[i]] += 1.0
    kv_now *= scale
    running *= scale
    levels = np.full(units, np.inf)
    levels[:d_units] = kv_now[:d_units]
    need = np.empty(cand.size)
    for c in range(cand.size):
        need[c] = (inputs[cand[c]] + outputs[cand[c]] / 2) * scale
    if home.size:
        unit = home[cand].astype(np.int64)
        gone = np.flatnonzero(unit >= d_units)  # its unit stopped since: the least loaded takes it
        if gone.size:
            unit[gone] = water_fill(levels, need[gone])
    else:
        unit = water_fill(levels, need)
    fits = np.zeros(cand.size, dtype=np.bool_)
    added_kv, added = np.zeros(units), np.zeros(units)
    for c in range(cand.size):
        u = unit[c]
        added_kv[u] += need[c]
        added[u] += 1.0
        fits[c] = kv_now[u] + added_kv[u] <= kv_cap_unit and (
            running[u] + added[u] * scale <= batch_cap_unit
        )
    n_fit = int(fits.sum())
    n = a_idx.size
    new_idx = np.empty(n + n_fit, dtype=a_idx.dtype)
    new_unit = np.empty(n + n_fit, dtype=a_unit.dtype)
    new_done, new_from = np.empty(n + n_fit), np.empty(n + n_fit)
    new_idx[:n], new_unit[:n], new_done[:n], new_from[:n] = a_idx, a_unit, a_done, a_from
    stays = ~is_ready
    k = n
    for c in range(cand.size):
        r = cand[c]
        if fits[c]:
            new_idx[k], new_unit[k], new_done[k] = r, unit[c], 1.0
            new_from[k] = max(ready[positions[c]], t0)
            k += 1
        elif t1 - ready[positions[c]] > max_wait_s:
            status[r] = rejected
            reason[r] = 1
        else:
            stays[positions[c]] = True
    return new_idx, new_unit, new_done, new_from, pend[stays]
