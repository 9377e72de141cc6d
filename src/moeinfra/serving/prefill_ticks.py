"""The prefill side of a simulation, tick by tick, and its reuse by runs that differ only in decode.

In a disaggregated fleet whose prefill units do not share a host with decode units, nothing decode
does reaches prefill: which requests a tick routes, their first tokens, the refusals and the steps
formed depend on the workload, the prefill units' schedule and their step times alone. A
calibration's range runs (:mod:`moeinfra.serving.uncertainty`) repeat a day with every decode step
scaled and, for a calibration fitted on decode only, prefill unchanged: they replay the point
run's prefill ticks (:class:`PrefillShare`) instead of running the queue again, which is ~45% of a
run (docs/benchmarks.md). The figures are the same as a run of its own (a test compares them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeinfra.serving.prefill_queue import PrefillQueue
from moeinfra.serving.schedule import FleetSchedule
from moeinfra.serving.unit_cost import PrefillCost
from moeinfra.serving.workload import Workload


@dataclass(frozen=True)
class PrefillTick:
    """What the prefill units did in one tick (from :meth:`PrefillQueue.admit`): the requests
    whose first token became known (``idx``, their ``unit``, first-token seconds ``first_s``), those
    ``refused``, the steps formed (``spans``, ``[k, 3]``: unit, start, end), each unit's seconds of
    those steps (``work``, ``[max units]``), their starts and ends (``edges``), the requests still
    queued after the tick (``pending``) and the running units' busy share of the tick after it
    (``busy_share``, 0..1). A kept tick holds no ``unit`` and ``spans`` (None: only colocated
    units read them, and those never share) and ``edges`` only if asked."""

    idx: np.ndarray
    unit: np.ndarray | None
    first_s: np.ndarray
    refused: np.ndarray
    spans: np.ndarray | None
    work: np.ndarray
    edges: np.ndarray | None
    pending: int
    busy_share: float


class PrefillTicks:
    """The prefill units of a run advanced one tick at a time (tick ``k`` covers
    ``[k tick_s, min((k + 1) tick_s, duration_s))`` up to ``ticks`` whole ticks of ``tick_s``,
    then whole ticks; ``last_tick``: the last a run can ask for). With ``keep``, every tick is
    kept, compactly, so that other runs can read it back (:meth:`at`), with the steps' starts and
    ends if ``keep_edges``; the queue is let go once the last tick is kept."""

    def __init__(
        self,
        queue: PrefillQueue,
        arrival_s: np.ndarray,
        schedule: FleetSchedule,
        tick_s: float,
        ticks: int,
        duration_s: float,
        last_tick: int,
        *,
        keep: bool = False,
        keep_edges: bool = False,
    ) -> None:
        self.queue: PrefillQueue | None = queue
        self._arrival, self._schedule = arrival_s, schedule
        self._tick_s, self._ticks, self._duration = tick_s, ticks, duration_s
        self._last_tick = last_tick
        self._units = schedule.max_units[0]
        self.keep, self.keep_edges = keep, keep and keep_edges
        self._rows: list[PrefillTick] = []
        self._next = 0
        self._lo = 0

    def at(self, tick: int, slowdown: float = 1.0) -> PrefillTick:
        """Tick ``tick`` (the next one, or one kept), its steps ``slowdown`` times as long (only
        when not kept: a kept tick must not depend on the run reading it)."""
        if tick < self._next:
            if not self.keep:
                raise ValueError(f"tick {tick} was not kept")
            return self._rows[tick]
        if self.keep and slowdown != 1.0:
            raise ValueError("kept prefill ticks cannot be slowed by a run's decode units")
        while self._next <= tick:
            row = self._advance(self._next, slowdown)
            if self.keep:
                self._rows.append(row)
            self._next += 1
        if self.keep and self._next > self._last_tick:
            self.queue = None  # every tick a run can ask for is kept
        return row

    def _advance(self, tick: int, slowdown: float) -> PrefillTick:
        if self.queue is None:
            raise ValueError(f"tick {tick} is past the last tick, {self._last_tick}")
        t0 = tick * self._tick_s
        t1 = min(t0 + self._tick_s, self._duration) if tick < self._ticks else t0 + self._tick_s
        p_units = int(self._schedule.at(t0)[0])
        hi = int(np.searchsorted(self._arrival, t1, side="left"))
        idx, unit, first, refused, spans = self.queue.admit(
            self._lo, hi, p_units, slowdown, until=t1
        )
        self._lo = max(self._lo, hi)
        busy = self.queue.busy[:p_units]
        share = float(np.clip((busy - t0) / self._tick_s, 0.0, 1.0).mean())
        work = np.bincount(spans[:, 0].astype(np.int64), spans[:, 2] - spans[:, 1], self._units)
        if not self.keep:
            edges = np.concatenate([spans[:, 1], spans[:, 2]])
            return PrefillTick(
                idx, unit, first, refused, spans, work, edges, self.queue.pending, share
            )
        # kept: 4-byte indices, no units or spans (~16 bytes a request, 8 a unit and tick)
        edges = np.concatenate([spans[:, 1], spans[:, 2]]) if self.keep_edges else None
        return PrefillTick(
            idx.astype(np.int32),
            None,
            first,
            refused.astype(np.int32),
            None,
            work,
            edges,
            self.queue.pending,
            share,
        )


def _same_requests(a: Workload, b: Workload | None) -> bool:
    return b is not None and (
        a is b
        or (
            a.scale == b.scale
            and all(
                np.array_equal(getattr(a, f), getattr(b, f))
                for f in ("arrival_s", "input_tokens", "output_tokens", "cached_tokens")
            )
        )
    )


class PrefillShare:
    """Prefill ticks kept by the first run that is given this object and read back by the later
    runs whose prefill side is the same (same requests, prefill costs, prefill units over
    time, tick, window, queue limit and seed): pass one to :func:`~moeinfra.serving.simulate.simulate`
    (``prefill_share=``) for each run. A run whose prefill side differs, or depends on its decode
    units (colocated units, or prefill slowed by decode on a shared host), runs its own."""

    def __init__(self) -> None:
        self.ticks: PrefillTicks | None = None
        self._key: tuple | None = None
        self._workload: Workload | None = None
        self._cost: PrefillCost | None = None
        self.reused = 0  # runs that read the kept ticks back

    @staticmethod
    def key(schedule: FleetSchedule, tick_s: float, ticks: int, duration_s: float, limit: tuple):
        """The scalar part of a prefill side's identity (the arrays are compared apart)."""
        return (
            schedule.start_s.tobytes(),
            schedule.prefill_units.tobytes(),
            schedule.prefill_nodes,
            schedule.max_units[0],
            tick_s,
            ticks,
            duration_s,
            limit,
        )

    def matches(
        self, workload: Workload, cost: PrefillCost, key: tuple, edges: bool = False
    ) -> bool:
        """Whether the kept ticks are those of a run with this workload, costs and ``key``
        (and hold the steps' starts and ends if the run needs ``edges``)."""
        if self.ticks is None or key != self._key or not _same_requests(workload, self._workload):
            return False
        if edges and not self.ticks.keep_edges:
            return False
        kept = self._cost
        return (
            np.array_equal(kept.work_s, cost.work_s)
            and np.array_equal(kept.tokens, cost.tokens)
            and np.array_equal(kept.step_tokens, cost.step_tokens)
            and np.array_equal(kept.step_rank_s, cost.step_rank_s)
            and np.array_equal(kept.step_routed_s, cost.step_routed_s)
            and (kept.ranks, kept.rank_budget, kept.request_overhead_s, kept.step_jitter)
            == (cost.ranks, cost.rank_budget, cost.request_overhead_s, cost.step_jitter)
        )

    def keep(self, ticks: PrefillTicks, workload: Workload, cost: PrefillCost, key: tuple) -> None:
        self.ticks, self._workload, self._cost, self._key = ticks, workload, cost, key
