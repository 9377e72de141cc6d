"""The prefill units' FIFO queues with least-outstanding-work routing, shared by the simulator and
the TTFT autoscaler so that both see the same first-token times.

Each request, in arrival order, goes to the running unit that frees up first (the least outstanding
work), where it waits for the unit's earlier requests: one FIFO queue in front of the units (M/G/c
when arrivals are Poisson). The loop is compiled with numba (a day has ~1.5M sampled requests).

Sampling rule (docs/serving-model.md): a sampled request carries ``scale`` requests' work, so the
simulated queue is lumpy; at fixed utilisation the queueing delay scales with the lump size
(Pollaczek-Khinchine), so a request waits the simulated wait / ``scale``, plus in full any backlog
beyond ten lumps (a real, sustained queue), then its own service. At ``scale = 1`` it is exact.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def least_work_fifo(
    arrival, work, busy, units, max_wait_s, unit_out, start_out
):  # pragma: no cover
    """Route requests (sorted by arrival) to the unit among ``busy[:units]`` that frees up first;
    each starts when its unit is free. ``busy`` is updated in place. A request that would wait more
    than ``max_wait_s`` is refused (``unit_out = -1``) and leaves ``busy`` unchanged."""
    for i in range(arrival.size):
        best = 0
        for u in range(1, units):
            if busy[u] < busy[best]:
                best = u
        if busy[best] - arrival[i] > max_wait_s:
            unit_out[i] = -1
            continue
        start = max(busy[best], arrival[i])
        busy[best] = start + work[i]
        unit_out[i] = best
        start_out[i] = start


class PrefillQueue:
    """Prefill units as one FIFO queue. ``work_s``: ``[n]`` unit-seconds per sampled request
    (already ``scale`` requests' worth); ``min_latency_s``: ``[n]`` the fastest each first token
    can come."""

    def __init__(
        self,
        arrival_s: np.ndarray,
        work_s: np.ndarray,
        min_latency_s: np.ndarray,
        scale: float,
        max_units: int,
        max_wait_s: float = np.inf,
    ) -> None:
        self.arrival = np.ascontiguousarray(arrival_s, dtype=np.float64)
        self.work = np.ascontiguousarray(work_s, dtype=np.float64)
        self.min_latency = min_latency_s
        self.scale, self.max_wait_s = float(scale), float(max_wait_s)
        self.busy = np.zeros(max_units)
        self.lump_allowance = 10.0 * (float(work_s.mean()) if work_s.size else 0.0)

    def reset(self) -> None:
        """Empty every unit's queue (to run another trial on the same requests)."""
        self.busy[:] = 0.0

    def admit(self, lo: int, hi: int, units: int, slowdown: float = 1.0):
        """Queue requests ``lo..hi-1`` on the first ``units`` units, their work taking
        ``slowdown`` times as long (units sharing a host's cores with busy decode units).

        Returns ``(accepted, unit, first_token_s, refused, busy)``: indices, their unit and
        first-token time, the indices refused for waiting longer than ``max_wait_s``, and each
        accepted request's ``[start, end)`` on its unit (``[n, 2]``, the queue's own clock: a
        sampled request occupies its unit ``scale`` requests' time).
        """
        unit = np.empty(hi - lo, dtype=np.int64)
        start = np.empty(hi - lo)
        arrival, work = self.arrival[lo:hi], self.work[lo:hi] * slowdown
        least_work_fifo(arrival, work, self.busy, units, self.max_wait_s, unit, start)
        ok = unit >= 0
        idx = np.arange(lo, hi)
        wait = start[ok] - arrival[ok]
        wait = np.minimum(wait, self.lump_allowance) / self.scale + np.maximum(
            wait - self.lump_allowance, 0.0
        )
        own = np.maximum(work[ok] / self.scale, self.min_latency[idx[ok]] * slowdown)
        first = arrival[ok] + wait + own
        busy = np.stack([start[ok], start[ok] + work[ok]], axis=1)
        return idx[ok], unit[ok], first, idx[~ok], busy
