"""Interval arithmetic and the decomposition checked against a brute-force reference (hypothesis)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_builders import kernel, write_trace

from moeinfra.trace import intervals
from moeinfra.trace.classify import COMM, COMPUTE, MEMORY, Classifier
from moeinfra.trace.overlap import decompose
from moeinfra.trace.reader import read_trace

GRID = 60

interval_lists = st.lists(
    st.tuples(st.integers(0, GRID), st.integers(0, 12)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=12,
)


def cells(pairs) -> np.ndarray:
    """Brute force: one boolean per unit cell [i, i+1)."""
    mask = np.zeros(GRID + 20, dtype=bool)
    for s, e in pairs:
        mask[s:e] = True
    return mask


def as_set(pairs) -> intervals.IntervalSet:
    arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    return intervals.union(arr[:, 0], arr[:, 1])


def set_cells(interval_set) -> np.ndarray:
    return cells(zip(interval_set[0].tolist(), interval_set[1].tolist(), strict=True))


@given(interval_lists)
def test_union_is_canonical_and_matches_brute_force(pairs):
    s, e = as_set(pairs)
    assert np.all(e > s)
    assert np.all(s[1:] > e[:-1])  # sorted, disjoint, not touching
    assert np.array_equal(set_cells((s, e)), cells(pairs))
    assert intervals.length((s, e)) == cells(pairs).sum()


@given(interval_lists, interval_lists)
def test_intersect_subtract_match_brute_force(a, b):
    sa, sb = as_set(a), as_set(b)
    assert np.array_equal(set_cells(intervals.intersect(sa, sb)), cells(a) & cells(b))
    assert np.array_equal(set_cells(intervals.subtract(sa, sb)), cells(a) & ~cells(b))
    assert np.array_equal(set_cells(intervals.union_sets(sa, sb)), cells(a) | cells(b))


@given(interval_lists, interval_lists)
def test_covered_length_per_interval(a, b):
    sb = as_set(b)
    arr = np.asarray(a, dtype=np.int64).reshape(-1, 2)
    got = intervals.covered_length(sb, arr[:, 0], arr[:, 1])
    mb = cells(b)
    want = [int(mb[s:e].sum()) for s, e in a]
    assert got.tolist() == want


def test_empty_and_degenerate_intervals():
    s, e = intervals.union(np.array([5, 3]), np.array([5, 2]))
    assert s.size == 0 and e.size == 0
    assert intervals.length(intervals.intersect(intervals.empty(), intervals.empty())) == 0
    # touching half-open intervals merge, their length adds up
    s, e = intervals.union(np.array([0, 10]), np.array([10, 20]))
    assert s.tolist() == [0] and e.tolist() == [20]


ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["gemm", "ncclDevKernel_AllReduce", "Memcpy DtoD (Device -> Device)"]),
        st.integers(0, 3),  # stream
        st.integers(0, GRID),
        st.integers(0, 10),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=60, deadline=None)
@given(ops_strategy)
def test_decomposition_matches_brute_force_and_adds_up(ops):
    events = []
    for name, stream, ts, dur in ops:
        cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        events.append(kernel(name, ts, dur, stream=stream, cat=cat))
    with tempfile.TemporaryDirectory() as tmp:
        trace = read_trace(write_trace(Path(tmp) / "t.json", events))
    classes = Classifier().classify(trace.gpu)
    (dec,) = decompose(trace, classes)
    masks = {code: np.zeros(GRID + 20, dtype=bool) for code in (COMPUTE, COMM, MEMORY)}
    code_of = {
        "gemm": COMPUTE,
        "ncclDevKernel_AllReduce": COMM,
        "Memcpy DtoD (Device -> Device)": MEMORY,
    }
    for name, _, ts, dur in ops:
        masks[code_of[name]][ts : ts + dur] = True
    c, k, m = masks[COMPUTE], masks[COMM], masks[MEMORY]
    ns = 1000  # the builder writes µs
    assert dec.compute_ns == c.sum() * ns
    assert dec.comm_ns == k.sum() * ns
    assert dec.memory_ns == m.sum() * ns
    assert dec.overlap_ns == (c & k).sum() * ns
    assert dec.exposed_comm_ns == (k & ~c).sum() * ns
    assert dec.exposed_memory_ns == (m & ~c & ~k).sum() * ns
    assert dec.busy_ns == (c | k | m).sum() * ns
    assert dec.compute_ns + dec.exposed_comm_ns + dec.exposed_memory_ns + dec.idle_ns == dec.span_ns
    starts = [ts for _, _, ts, _ in ops]
    ends = [ts + dur for _, _, ts, dur in ops]
    assert dec.span_ns == (max(ends) - min(starts)) * ns
