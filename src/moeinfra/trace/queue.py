"""Queue length per stream: how many launched GPU ops are waiting (as in HTA), over time.

Every GPU op joined to its launch call (:mod:`~moeinfra.trace.launches`) adds 1 to its stream's
queue when the launch call starts and takes 1 away when the op starts (``until="start"``, Holistic
Trace Analysis' ``get_queue_length_time_series``: launched but not yet running) or when it ends
(``until="end"``: launched but not yet finished, what the stream still holds). At equal times the
additions come first, so the length never dips below 0 for an op launched and started at once.

The series is a step function: ``length[i]`` holds from ``ts[i]`` to ``ts[i+1]``. Its summary gives
HTA's statistics over the *changes* (``count, mean, std, min, 25%, 50%, 75%, max`` of the length
after each change; ``std`` with ddof=1 and linear percentiles as pandas' ``describe``), and, besides,
the time-weighted mean and the time spent at or above ``max_queue_length`` (HTA's
``get_time_spent_blocked_on_full_queue``; default 1024, HTA's ``CUDA_MAX_LAUNCH_QUEUE_PER_STREAM``):
a full queue blocks the CPU in the launch call.

Where this differs from HTA: ties are ordered (additions first; HTA's unstable sort leaves them in
any order, which changes only the statistics over changes, never the time-based ones); the
time at the limit is reported for every stream (HTA keeps one stream per rank) and relative to
the stream's own series span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from moeinfra.errors import InputError
from moeinfra.trace.launches import launch_table
from moeinfra.trace.model import Trace

#: HTA's ``CUDA_MAX_LAUNCH_QUEUE_PER_STREAM``.
DEFAULT_MAX_QUEUE_LENGTH = 1024
Until = Literal["start", "end"]


@dataclass(frozen=True)
class QueueSeries:
    """Queue length of one stream as a step function: ``length[i]`` from ``ts_ns[i]`` on, ``[k]`` each."""

    rank: int
    device: int
    stream: int
    ts_ns: np.ndarray  # int64
    length: np.ndarray  # int64


@dataclass(frozen=True)
class QueueSummary:
    """Statistics of one stream's queue length (see the module docstring); times ns."""

    rank: int
    device: int
    stream: int
    changes: int
    mean: float
    std: float
    min: int
    p25: float
    p50: float
    p75: float
    max: int
    time_mean: float
    span_ns: int
    time_at_max_ns: int
    max_queue_length: int

    def to_dict(self) -> dict:
        """JSON-ready dict, times in µs."""
        return {
            "rank": self.rank,
            "device": self.device,
            "stream": self.stream,
            "count": self.changes,
            "mean": self.mean,
            "std": self.std,
            "min": self.min,
            "25%": self.p25,
            "50%": self.p50,
            "75%": self.p75,
            "max": self.max,
            "time_weighted_mean": self.time_mean,
            "span_us": self.span_ns * 1e-3,
            "max_queue_length": self.max_queue_length,
            "time_at_max_queue_length_us": self.time_at_max_ns * 1e-3,
            "relative_time_at_max_queue_length": (
                self.time_at_max_ns / self.span_ns if self.span_ns else 0.0
            ),
        }


def queue_series(trace: Trace, until: Until = "start") -> list[QueueSeries]:
    """Queue-length step function of every (rank, device, stream) that has launched ops."""
    if until not in ("start", "end"):
        raise InputError(f"until={until!r} is not allowed; use 'start' or 'end'")
    gpu, cpu = trace.gpu, trace.cpu
    table = launch_table(trace)
    if len(table) == 0:
        return []
    ops = table.op  # ascending: grouped by (rank, device, stream) as the model sorts ops
    leave = gpu.start_ns[ops] if until == "start" else gpu.end_ns[ops]
    key = np.stack(
        [gpu.rank[ops].astype(np.int64), gpu.device[ops].astype(np.int64), gpu.stream[ops]], axis=1
    )
    cuts = np.flatnonzero((key[1:] != key[:-1]).any(axis=1)) + 1
    out = []
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [ops.size]]), strict=True):
        enter_ts = cpu.start_ns[table.call[lo:hi]]
        ts = np.concatenate([enter_ts, leave[lo:hi]])
        delta = np.concatenate([np.ones(hi - lo, np.int64), -np.ones(hi - lo, np.int64)])
        order = np.lexsort((-delta, ts))  # by time, additions first at ties
        out.append(
            QueueSeries(
                rank=int(key[lo, 0]),
                device=int(key[lo, 1]),
                stream=int(key[lo, 2]),
                ts_ns=ts[order],
                length=np.cumsum(delta[order]),
            )
        )
    return out


def summarize_series(
    series: QueueSeries, max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH
) -> QueueSummary:
    """HTA's statistics over the changes, plus time-weighted mean and time at the limit."""
    if max_queue_length < 1:
        raise InputError(f"max_queue_length={max_queue_length} must be >= 1")
    ts, length = series.ts_ns, series.length
    hold = np.diff(ts)  # how long each value but the last holds
    span = int(ts[-1] - ts[0])
    p25, p50, p75 = np.percentile(length, [25, 50, 75])
    time_mean = float((length[:-1] * hold).sum() / span) if span else float(length.mean())
    return QueueSummary(
        rank=series.rank,
        device=series.device,
        stream=series.stream,
        changes=int(length.size),
        mean=float(length.mean()),
        std=float(length.std(ddof=1)) if length.size > 1 else 0.0,
        min=int(length.min()),
        p25=float(p25),
        p50=float(p50),
        p75=float(p75),
        max=int(length.max()),
        time_mean=time_mean,
        span_ns=span,
        time_at_max_ns=int(hold[length[:-1] >= max_queue_length].sum()),
        max_queue_length=max_queue_length,
    )


def queue_summary(
    trace: Trace, until: Until = "start", max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH
) -> list[QueueSummary]:
    """:func:`summarize_series` of every stream of :func:`queue_series`."""
    return [summarize_series(s, max_queue_length) for s in queue_series(trace, until)]
