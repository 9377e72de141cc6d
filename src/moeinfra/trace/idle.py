"""Idle-time breakdown: why the GPU waited — host wait, kernel wait or other (as in HTA).

Per stream (Holistic Trace Analysis, ``get_idle_time_breakdown``): the ops of a stream (kernels,
memcpy, memset), sorted by start, leave *gaps* ``start[i] − end of the ops before i``. A gap is

- **host wait** when the runtime call that launched op ``i`` started after the gap began: the CPU
  had not yet asked for the work (the GPU waited for the host);
- **kernel wait** otherwise, when the gap is shorter than ``kernel_wait_ns`` (HTA's
  ``consecutive_kernel_delay``, default 30 in the trace's unit, i.e. 30 µs for Kineto traces):
  the overhead between back-to-back launches;
- **other** otherwise (e.g. waiting on an event from another stream).

An op without a launching runtime call (no correlation id) is never host wait. Per stream,
``host_wait + kernel_wait + other = span − busy`` exactly (ns), span being first op start to last op
end of the stream. The same rule applied to the gaps of the *device* (the union of all its streams)
splits :class:`~moeinfra.trace.overlap.Decomposition`'s ``idle`` exactly: the op that ends a device
gap is the one starting at the gap's end (the earliest-launched one if several start there).

Where this differs from HTA: the gap is measured from the latest end of all earlier ops of the stream
(HTA: the previous op's end; equal unless ops of one stream overlap, which would make HTA count a
negative gap); only gaps > 0 are counted as idle intervals (HTA's interval statistics also count
zero-length gaps); times are exact ns (HTA rounds fractional µs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeinfra.trace import intervals
from moeinfra.trace.attribution import link_launches
from moeinfra.trace.model import Trace

IDLE_CATEGORIES = ("host_wait", "kernel_wait", "other")
HOST_WAIT, KERNEL_WAIT, OTHER = 0, 1, 2
#: HTA's default ``consecutive_kernel_delay`` (30, compared with µs timestamps): 30 µs.
DEFAULT_KERNEL_WAIT_NS = 30_000


@dataclass(frozen=True)
class IdleBreakdown:
    """Idle time of one stream (``stream`` set) or one device (``stream`` None), in ns.

    ``idle_ns[c]`` and ``gaps[c]`` are the total length and the number of gaps of category ``c``
    (``IDLE_CATEGORIES`` order); ``max_gap_ns[c]`` is the longest gap of that category (0 if none).
    """

    rank: int
    device: int
    stream: int | None
    ops: int
    start_ns: int
    end_ns: int
    busy_ns: int
    idle_ns: tuple[int, ...]
    gaps: tuple[int, ...]
    max_gap_ns: tuple[int, ...]

    @property
    def span_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def total_idle_ns(self) -> int:
        return sum(self.idle_ns)

    def to_dict(self) -> dict:
        """JSON-ready dict, times in µs; ``ratio`` = share of the idle time (None without idle)."""
        us = 1e-3
        total = self.total_idle_ns
        out: dict = {"rank": self.rank, "device": self.device}
        if self.stream is not None:
            out["stream"] = self.stream
        out.update(
            {
                "ops": self.ops,
                "span_us": self.span_ns * us,
                "busy_us": self.busy_ns * us,
                "idle_us": total * us,
            }
        )
        for i, name in enumerate(IDLE_CATEGORIES):
            out[name] = {
                "idle_us": self.idle_ns[i] * us,
                "ratio": self.idle_ns[i] / total if total else None,
                "gaps": self.gaps[i],
                "max_gap_us": self.max_gap_ns[i] * us,
            }
        return out


def classify_gaps(
    gap_ns: np.ndarray, gap_start_ns: np.ndarray, launch_start_ns: np.ndarray, kernel_wait_ns: int
) -> np.ndarray:
    """Category of each gap (int8 ``[n]``: HOST_WAIT / KERNEL_WAIT / OTHER).

    ``launch_start_ns`` is the start of the runtime call that launched the op ending the gap, -1
    where unknown (never host wait).
    """
    host = (launch_start_ns >= 0) & (launch_start_ns > gap_start_ns)
    kernel = ~host & (gap_ns < kernel_wait_ns)
    return np.where(host, HOST_WAIT, np.where(kernel, KERNEL_WAIT, OTHER)).astype(np.int8)


def _summarise(
    gap_ns: np.ndarray, category: np.ndarray
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per category: total gap length (exact int ns), number of gaps, longest gap."""
    total = tuple(int(gap_ns[category == c].sum()) for c in range(3))
    count = np.bincount(category, minlength=3)
    longest = np.zeros(3, dtype=np.int64)
    np.maximum.at(longest, category, gap_ns)
    return total, tuple(int(c) for c in count), tuple(int(x) for x in longest)


def _launch_starts(trace: Trace, launch: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = np.full(rows.shape, -1, dtype=np.int64)
    linked = launch[rows] >= 0
    out[linked] = trace.cpu.start_ns[launch[rows][linked]]
    return out


def stream_idle(
    trace: Trace,
    kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS,
    launch: np.ndarray | None = None,
) -> list[IdleBreakdown]:
    """Idle breakdown of every (rank, device, stream), in model order (HTA's per-stream view)."""
    gpu = trace.gpu
    if len(gpu) == 0:
        return []
    launch = link_launches(trace) if launch is None else launch
    key = np.stack([gpu.rank.astype(np.int64), gpu.device.astype(np.int64), gpu.stream], axis=1)
    cuts = np.flatnonzero((key[1:] != key[:-1]).any(axis=1)) + 1
    out = []
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(gpu)]]), strict=True):
        rows = np.arange(lo, hi)  # sorted by start within a stream
        start, end = gpu.start_ns[rows], gpu.end_ns[rows]
        reach = np.maximum.accumulate(end)  # latest end of the ops so far
        gap = start[1:] - reach[:-1]
        has_gap = gap > 0
        nxt = rows[1:][has_gap]
        category = classify_gaps(
            gap[has_gap], reach[:-1][has_gap], _launch_starts(trace, launch, nxt), kernel_wait_ns
        )
        idle, count, longest = _summarise(gap[has_gap], category)
        out.append(
            IdleBreakdown(
                rank=int(gpu.rank[lo]),
                device=int(gpu.device[lo]),
                stream=int(gpu.stream[lo]),
                ops=int(hi - lo),
                start_ns=int(start[0]),
                end_ns=int(reach[-1]),
                busy_ns=intervals.length(intervals.union(start, end)),
                idle_ns=idle,
                gaps=count,
                max_gap_ns=longest,
            )
        )
    return out


def device_idle(
    trace: Trace,
    rows: slice,
    kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS,
    launch: np.ndarray | None = None,
) -> IdleBreakdown:
    """Idle breakdown of the device whose GPU ops are the rows ``rows`` (all its streams together).

    The categories sum to the device's ``idle`` of :mod:`~moeinfra.trace.overlap` exactly.
    """
    gpu = trace.gpu
    launch = link_launches(trace) if launch is None else launch
    start, end = gpu.start_ns[rows], gpu.end_ns[rows]
    busy_s, busy_e = intervals.union(start, end)
    gap_start, gap_end = busy_e[:-1], busy_s[1:]
    idx = np.arange(rows.start, rows.stop)
    # The op ending each gap: among the ops starting at the gap's end, the earliest-launched one
    # (an op without a launch sorts last, so a known launch decides).
    launch_start = _launch_starts(trace, launch, idx)
    rank_key = np.where(launch_start >= 0, launch_start, np.iinfo(np.int64).max)
    order = np.lexsort((rank_key, start))
    s_sorted = start[order]
    pos = np.searchsorted(s_sorted, gap_end, side="left")
    ending = order[pos]
    category = classify_gaps(gap_end - gap_start, gap_start, launch_start[ending], kernel_wait_ns)
    idle, count, longest = _summarise(gap_end - gap_start, category)
    return IdleBreakdown(
        rank=int(gpu.rank[rows.start]),
        device=int(gpu.device[rows.start]),
        stream=None,
        ops=int(rows.stop - rows.start),
        start_ns=int(start.min()),
        end_ns=int(end.max()),
        busy_ns=intervals.length((busy_s, busy_e)),
        idle_ns=idle,
        gaps=count,
        max_gap_ns=longest,
    )


def idle_breakdown(
    trace: Trace, kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS
) -> tuple[list[IdleBreakdown], list[IdleBreakdown]]:
    """Per-device and per-stream idle breakdowns of ``trace`` (``kernel_wait_ns``: the kernel-wait
    threshold in ns, default HTA's 30 µs)."""
    if kernel_wait_ns < 0:
        from moeinfra.errors import InputError

        raise InputError(f"kernel_wait_ns={kernel_wait_ns} must be >= 0")
    launch = link_launches(trace)
    devices = [
        device_idle(trace, rows, kernel_wait_ns, launch) for rows in trace.device_slices().values()
    ]
    return devices, stream_idle(trace, kernel_wait_ns, launch)
