"""Injected delay semantics (single process) and micro-batch split invariants (fuzzed)."""

import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeinfra.moe.comm import Communicator
from moeinfra.moe.mla import Segment
from moeinfra.moe.runtime import split_micro_batches
from moeinfra.moe.timeline import COMM_TRACK, Recorder


def test_delay_is_paid_at_wait_unless_hidden_by_work():
    # Wall-clock bounds with wide margins (a loaded machine only makes waits longer): an exposed
    # 0.2 s delay is at least 0.2 s; a hidden one returns well before a delay's length.
    rec = Recorder()
    comm = Communicator(delay_s=0.2, recorder=rec)
    x = torch.randn(6, 4)
    start = time.perf_counter()
    out, _ = comm.all_to_all(x, [6], [6], "exposed").wait()
    assert time.perf_counter() - start >= 0.2
    assert out is x  # one rank: nothing moves, the sent rows are the received rows
    pending = comm.all_to_all(x, [6], [6], "hidden")
    time.sleep(0.25)  # work between issue and wait hides the delay
    waited = time.perf_counter()
    pending.wait()
    assert time.perf_counter() - waited < 0.15
    names = [e[0] for e in rec.events if e[1] == COMM_TRACK]
    assert names == ["exposed", "hidden"]
    assert all(e[3] - e[2] >= 0.2 for e in rec.events)
    rows, counts = comm.dispatch(x, torch.tensor([2, 4]), "d").wait()
    assert torch.equal(rows, x) and counts.tolist() == [2, 4]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=0, max_size=8),
    allow_split=st.booleans(),
)
def test_split_invariants(lengths, allow_split):
    segments = [Segment(i, 0, n) for i, n in enumerate(lengths)]
    total = sum(lengths)
    split = split_micro_batches(segments, allow_split=allow_split)
    t0, t1 = split.tokens()
    assert t0 + t1 == total
    assert torch.equal(torch.sort(torch.cat(split.rows)).values, torch.arange(total))
    if allow_split:
        assert t1 - t0 in (0, 1)
    else:
        assert all(s.start == 0 for segs in split.segments for s in segs)
    for m in range(2):  # rows and segments agree: each segment's rows are its own positions
        row = 0
        for s in split.segments[m]:
            first = split.rows[m][row].item()
            offset = sum(lengths[: s.seq])
            assert first == offset + s.start
            row += s.length
        assert row == len(split.rows[m])
