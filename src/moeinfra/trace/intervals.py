"""Half-open interval sets ``[start, end)`` as pairs of sorted int64 arrays, vectorised with numpy.

An *interval set* is ``(starts, ends)``, both shape ``[k]``, sorted, pairwise disjoint and
non-touching, every interval non-empty. :func:`union` turns any list of intervals (overlapping, in
any order, possibly empty) into one. Lengths are exact integers (the trace model uses ns).
"""

from __future__ import annotations

import numpy as np

IntervalSet = tuple[np.ndarray, np.ndarray]

_EMPTY = np.zeros(0, dtype=np.int64)


def empty() -> IntervalSet:
    """The empty interval set."""
    return _EMPTY.copy(), _EMPTY.copy()


def union(starts: np.ndarray, ends: np.ndarray) -> IntervalSet:
    """Union of intervals ``[starts[i], ends[i])`` (any order, overlaps allowed), shape ``[n]`` each.

    Empty and negative intervals are ignored; touching intervals are merged.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    keep = ends > starts
    if not keep.all():
        starts, ends = starts[keep], ends[keep]
    if starts.size == 0:
        return empty()
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    # A new merged interval begins where the start lies beyond everything before it.
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.concatenate([first[1:] - 1, [s.size - 1]])
    return s[first], reach[last]


def union_sets(*sets: IntervalSet) -> IntervalSet:
    """Union of several interval sets."""
    if not sets:
        return empty()
    return union(np.concatenate([s for s, _ in sets]), np.concatenate([e for _, e in sets]))


def length(interval_set: IntervalSet) -> int:
    """Total length of an interval set (same unit as its bounds)."""
    s, e = interval_set
    return int((e - s).sum())


def _combine(a: IntervalSet, b: IntervalSet, keep_a: bool, keep_b: bool, both: bool) -> IntervalSet:
    """Elementary segments between all boundaries, kept by membership (in a only / b only / both)."""
    points = np.concatenate([a[0], a[1], b[0], b[1]])
    if points.size == 0:
        return empty()
    da = np.concatenate(
        [
            np.ones(a[0].size, np.int64),
            -np.ones(a[1].size, np.int64),
            np.zeros(b[0].size * 2, np.int64),
        ]
    )
    db = np.concatenate(
        [
            np.zeros(a[0].size * 2, np.int64),
            np.ones(b[0].size, np.int64),
            -np.ones(b[1].size, np.int64),
        ]
    )
    order = np.argsort(points, kind="stable")
    p = points[order]
    ina = np.cumsum(da[order]) > 0
    inb = np.cumsum(db[order]) > 0
    # Segment i is [p[i], p[i+1]) with membership given by the state after point i.
    seg_a, seg_b = ina[:-1], inb[:-1]
    keep = (seg_a & ~seg_b & keep_a) | (~seg_a & seg_b & keep_b) | (seg_a & seg_b & both)
    return union(p[:-1][keep], p[1:][keep])


def intersect(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    """``a ∩ b`` of two interval sets."""
    return _combine(a, b, keep_a=False, keep_b=False, both=True)


def subtract(a: IntervalSet, b: IntervalSet) -> IntervalSet:
    """``a \\ b`` of two interval sets."""
    return _combine(a, b, keep_a=True, keep_b=False, both=False)


def covered_before(interval_set: IntervalSet, t: np.ndarray) -> np.ndarray:
    """``|interval_set ∩ (-inf, t)|`` for every ``t`` (shape ``[m]``): the covered length before t.

    With it, the part of any interval ``[x, y)`` covered by the set is
    ``covered_before(set, y) - covered_before(set, x)``, for many intervals at once.
    """
    s, e = interval_set
    t = np.asarray(t, dtype=np.int64)
    if s.size == 0:
        return np.zeros(t.shape, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(e - s)])  # covered length before s[i] is cum[i]
    i = np.searchsorted(s, t, side="right") - 1  # last interval starting at or before t
    inside = np.clip(t - s[np.maximum(i, 0)], 0, (e - s)[np.maximum(i, 0)])
    return np.where(i >= 0, cum[np.maximum(i, 0)] + inside, 0)


def covered_length(interval_set: IntervalSet, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per-interval covered length ``|[starts[i], ends[i]) ∩ interval_set|``, shape ``[n]``."""
    ends = np.maximum(np.asarray(ends, dtype=np.int64), np.asarray(starts, dtype=np.int64))
    return covered_before(interval_set, ends) - covered_before(interval_set, starts)
