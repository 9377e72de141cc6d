"""The micro-batch split's tie-breaks, worked by hand from ``split_micro_batches``' docstring
(issue #18): equal lengths keep their order, an equal attention cost sends a sequence to micro-batch
1, a cut between two sequence boundaries equally far from the middle takes the later one, and an odd
token count gives micro-batch 1 the extra token."""

import pytest

torch = pytest.importorskip("torch")

from moeinfra.moe.mla import Segment  # noqa: E402
from moeinfra.moe.runtime import attention_cost, split_micro_batches  # noqa: E402


def _rows(split):
    return [split.rows[m].tolist() for m in (0, 1)]


def test_equal_sequences_alternate_starting_with_micro_batch_one():
    # Four sequences of 3 tokens from position 0, rows 0-2, 3-5, 6-8, 9-11; each costs 6.
    # Longest first with ties in order: s0 -> mb1 (costs tie 0/0), s1 -> mb0 (6 > 0),
    # s2 -> mb1 (6/6 tie), s3 -> mb0. Stream mb1 then mb0: s0 s2 | s1 s3; cut at 6 tokens.
    segments = [Segment(i, 0, 3) for i in range(4)]
    assert attention_cost(0, 3) == 6
    split = split_micro_batches(segments)
    assert [[s.seq for s in split.segments[m]] for m in (0, 1)] == [[1, 3], [0, 2]]
    assert _rows(split) == [[3, 4, 5, 9, 10, 11], [0, 1, 2, 6, 7, 8]]
    assert split.attention_costs() == (12, 12)


def test_a_cut_equally_far_from_two_boundaries_takes_the_later_one():
    # Decode: three one-token sequences at position 10 (cost 11 each). Sides: s0 -> mb1, s1 -> mb0,
    # s2 -> mb1 (11 <= 11). Stream s0 s2 s1, boundaries 0 1 2 3 around a middle of 1.5:
    # 1 and 2 are equally far; the later one (2) is taken, so mb1 holds two sequences.
    segments = [Segment(i, 10, 1) for i in range(3)]
    split = split_micro_batches(segments, allow_split=False)
    assert [[s.seq for s in split.segments[m]] for m in (0, 1)] == [[1], [0, 2]]
    assert _rows(split) == [[1], [0, 2]]
    assert split.tokens() == (1, 2)


def test_an_odd_prefill_gives_micro_batch_one_the_extra_token_and_the_prefix():
    # One 7-token sequence from position 5 (rows 0-6): cut at (7 + 1) // 2 = 4 tokens.
    split = split_micro_batches([Segment(0, 5, 7)])
    assert split.segments[1] == [Segment(0, 5, 4)]
    assert split.segments[0] == [Segment(0, 9, 3)]
    assert _rows(split) == [[4, 5, 6], [0, 1, 2, 3]]
    assert (
        split.attention_costs() == (attention_cost(9, 3), attention_cost(5, 4)) == (33, 30)
    )  # keys 10+11+12 and 6+7+8+9


def test_a_longer_sequence_goes_first_whatever_its_place():
    # Lengths 2, 5, 2 (rows 0-1, 2-6, 7-8), all from 0: s1 (cost 15) -> mb1, then s0 (cost 3)
    # -> mb0 (15 > 0), s2 -> mb0 (15 > 3). Stream s1 | s0 s2, 9 tokens, cut at 5: exactly s1.
    segments = [Segment(0, 0, 2), Segment(1, 0, 5), Segment(2, 0, 2)]
    split = split_micro_batches(segments)
    assert [[s.seq for s in split.segments[m]] for m in (0, 1)] == [[0, 2], [1]]
    assert _rows(split) == [[0, 1, 7, 8], [2, 3, 4, 5, 6]]
