"""Load-balancing policies."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeinfra.errors import InputError
from moeinfra.serving.balancers import (
    DecodeLoadBalancer,
    LeastRequests,
    PrefillLoadBalancer,
    RoundRobin,
    attention_cost,
    decode_imbalance,
    fill_least_loaded,
)
from moeinfra.serving.workload import LengthModel, cached_prefix


def sample(n, seed=0):
    rng = np.random.default_rng(seed)
    inputs, outputs = LengthModel.from_published().sample(n, rng)
    return inputs, cached_prefix(inputs, 0.563, rng), outputs


def test_prefill_pieces_cover_every_uncached_token():
    inputs, cached, _ = sample(300)
    placed = PrefillLoadBalancer(32, 4096).assign(inputs, cached)
    per_request = np.bincount(placed.request, placed.length, inputs.size)
    np.testing.assert_array_equal(per_request, inputs - cached)
    assert placed.length.max() <= 4096
    # a later piece of a prompt attends to the earlier ones
    assert placed.attention.sum() == pytest.approx(
        attention_cost(inputs - cached, cached).sum(), rel=0.5
    )


def test_prefill_balancer_beats_round_robin():
    inputs, cached, _ = sample(400, seed=1)
    ours = PrefillLoadBalancer(32).assign(inputs, cached).imbalance()
    base = RoundRobin(32).assign(inputs, cached).imbalance()
    assert ours["attention"] < base["attention"]
    assert ours["tokens"] < base["tokens"]
    assert ours["micro_batch"] <= 1.05


def test_decode_balancer_beats_least_requests_on_kv():
    inputs, _, outputs = sample(144 * 40, seed=2)
    kv = inputs + outputs / 2
    ours = decode_imbalance(DecodeLoadBalancer(144).assign_decode(kv), kv, 144)
    base = decode_imbalance(LeastRequests(144).assign_decode(kv), kv, 144)
    assert ours["kv"] < base["kv"]
    assert ours["requests"] <= 1.1


def test_decode_balancer_respects_existing_load():
    rank = DecodeLoadBalancer(4).assign_decode(
        np.full(3, 100.0), rank_kv=np.array([1e6, 0, 0, 0]), rank_requests=np.array([10, 0, 0, 0])
    )
    assert 0 not in rank
    with pytest.raises(InputError, match="shape"):
        DecodeLoadBalancer(4).assign_decode(np.ones(2), rank_kv=np.ones(3))


@settings(max_examples=40, deadline=None)
@given(
    levels=st.lists(st.one_of(st.floats(0, 100), st.just(float("inf"))), min_size=1, max_size=8),
    costs=st.lists(st.floats(0, 50), max_size=30),
)
def test_water_filling_only_uses_open_bins(levels, costs):
    levels = np.array(levels)
    if not np.isfinite(levels).any():
        with pytest.raises(InputError):
            fill_least_loaded(levels, np.array(costs))
        return
    out = fill_least_loaded(levels, np.array(costs, dtype=float))
    assert out.shape == (len(costs),)
    assert np.all(np.isfinite(levels[out]))


def test_water_filling_prefers_the_emptiest_bin():
    out = fill_least_loaded(np.array([10.0, 0.0, 5.0]), np.ones(4))
    assert set(out.tolist()) == {1}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 20_000), min_size=1, max_size=60), st.integers(1, 16))
def test_prefill_balancer_fuzz(lengths, ranks):
    inputs = np.array(lengths)
    cached = inputs // 3
    placed = PrefillLoadBalancer(ranks, 2048).assign(inputs, cached)
    assert np.all((placed.rank >= 0) & (placed.rank < ranks))
    assert set(np.unique(placed.micro_batch)) <= {0, 1}
    assert placed.rank_tokens.sum() == (inputs - cached).sum()


def test_prefill_balancer_counts_work_already_queued_on_ranks():
    balancer = PrefillLoadBalancer(num_ranks=3, max_piece_tokens=10_000)
    busy = np.array([5e6, 0.0, 4e6]), np.array([3000.0, 0.0, 2500.0])
    one = balancer.assign([1000], [0], rank_attention=busy[0], rank_tokens=busy[1])
    assert set(one.rank.tolist()) == {1}  # the idle rank, whatever its index
    two = balancer.assign([1000, 1000], [0, 0], rank_attention=busy[0], rank_tokens=busy[1])
    assert set(two.rank.tolist()) == {1}  # still below the others after the first
    assert one.rank_tokens.tolist() == [0.0, 1000.0, 0.0]  # totals count the new work only
    with pytest.raises(InputError, match="rank_attention"):
        balancer.assign([10], [0], rank_attention=[1.0, 2.0])
