"""Per-rank timeline of compute and communication intervals, Chrome-trace output, overlap fraction.

Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux: the same clock in every local
process, so the ranks' timelines line up). Intervals are half-open ``[start, end)``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeinfra.atomicio import atomic_path

COMPUTE_TRACK, COMM_TRACK = 0, 1
TRACK_NAMES = {COMPUTE_TRACK: "compute", COMM_TRACK: "communication"}


_NOTHING = contextlib.nullcontext()


@dataclass
class Recorder:
    """Collects ``(name, track, start_s, end_s)`` intervals of one rank; disabled ones record nothing."""

    rank: int = 0
    enabled: bool = True
    events: list[tuple[str, int, float, float]] = field(default_factory=list)

    def compute(self, name: str) -> contextlib.AbstractContextManager:
        """Record the enclosed code as a compute interval named ``name``."""
        if not self.enabled:
            return _NOTHING
        return self._interval(name)

    @contextlib.contextmanager
    def _interval(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append((name, COMPUTE_TRACK, start, time.perf_counter()))

    def comm(self, name: str, start: float, end: float) -> None:
        """Record a communication interval (issue to completion) named ``name``."""
        if self.enabled:
            self.events.append((name, COMM_TRACK, start, end))

    def clear(self) -> None:
        self.events.clear()


def _union(intervals: np.ndarray) -> np.ndarray:
    """Merge ``[n, 2]`` half-open intervals into a sorted disjoint ``[m, 2]`` array."""
    if intervals.size == 0:
        return intervals.reshape(0, 2)
    iv = intervals[np.argsort(intervals[:, 0], kind="stable")]
    iv = iv[iv[:, 1] > iv[:, 0]]
    if iv.size == 0:
        return iv.reshape(0, 2)
    ends = np.maximum.accumulate(iv[:, 1])
    new = np.ones(len(iv), dtype=bool)
    new[1:] = iv[1:, 0] > ends[:-1]
    starts = iv[new, 0]
    group = np.cumsum(new) - 1
    merged_ends = np.zeros(len(starts))
    np.maximum.at(merged_ends, group, ends)
    return np.stack([starts, merged_ends], axis=1)


def _length(intervals: np.ndarray) -> float:
    return float((intervals[:, 1] - intervals[:, 0]).sum()) if intervals.size else 0.0


def _intersection_length(a: np.ndarray, b: np.ndarray) -> float:
    """Length of the intersection of two disjoint sorted interval sets."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if hi > lo:
            total += hi - lo
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class Overlap:
    """Seconds of compute, communication, their overlap, and the hidden fraction (None: no comm)."""

    compute_s: float
    comm_s: float
    overlap_s: float

    @property
    def exposed_comm_s(self) -> float:
        return self.comm_s - self.overlap_s

    @property
    def hidden_fraction(self) -> float | None:
        return self.overlap_s / self.comm_s if self.comm_s > 0 else None


def overlap(events: Sequence[tuple[str, int, float, float]]) -> Overlap:
    """|C|, |K| and |K ∩ C| of one rank's events (unions of half-open intervals)."""
    arr = {t: [] for t in TRACK_NAMES}
    for _, track, start, end in events:
        arr[track].append((start, end))
    compute = _union(np.asarray(arr[COMPUTE_TRACK], dtype=np.float64).reshape(-1, 2))
    comm = _union(np.asarray(arr[COMM_TRACK], dtype=np.float64).reshape(-1, 2))
    return Overlap(_length(compute), _length(comm), _intersection_length(compute, comm))


def chrome_trace(per_rank_events: Sequence[Sequence[tuple[str, int, float, float]]]) -> dict:
    """Chrome-trace JSON object (µs) with one process per rank and a compute and a communication
    track (thread) each.

    Events are ``cat: "kernel"`` with ``args.device = rank`` and ``args.stream = track`` so
    ``moeinfra trace report`` reads them as GPU ops; communication names start with ``gloo:`` so its
    default rules classify them as communication.
    """
    starts = [e[2] for events in per_rank_events for e in events]
    origin = min(starts) if starts else 0.0
    out: list[dict] = []
    for rank, events in enumerate(per_rank_events):
        out.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for track, label in TRACK_NAMES.items():
            out.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": track,
                    "args": {"name": label},
                }
            )
        for name, track, start, end in events:
            out.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": ("gloo:" + name) if track == COMM_TRACK else name,
                    "pid": rank,
                    "tid": track,
                    "ts": round((start - origin) * 1e6, 3),
                    "dur": round(max(end - start, 0.0) * 1e6, 3),
                    "args": {"device": rank, "stream": track},
                }
            )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, per_rank_events) -> Path:
    """Write :func:`chrome_trace` to ``path`` atomically; return the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(chrome_trace(per_rank_events)))
    return path
