import numpy as np
import pytest
import torch

from moeinfra.eplb import LoadEstimator, rebalance, replica_for_tokens


def test_window_sums_the_last_steps():
    est = LoadEstimator(2, 3, window=2)
    steps = [np.full((2, 3), float(i)) for i in range(1, 5)]
    for step in steps:
        est.record(step)
    np.testing.assert_allclose(est.load(), steps[-1] + steps[-2])
    assert est.steps == 4
    est.reset()
    np.testing.assert_allclose(est.load(), 0.0)


def test_ema_is_bias_corrected():
    est = LoadEstimator(1, 2, ema=0.1)
    est.record(np.array([[10.0, 0.0]]))
    np.testing.assert_allclose(est.load(), [[10.0, 0.0]])  # one step: the step itself
    est.record(np.array([[0.0, 10.0]]))
    m = 0.1 * np.array([0.0, 10.0]) + 0.9 * 0.1 * np.array([10.0, 0.0])
    np.testing.assert_allclose(est.load(), [m / (1 - 0.9**2)])


def test_estimator_accepts_torch_and_checks_shape():
    est = LoadEstimator(1, 2, window=3)
    est.record(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="counts shape"):
        est.record(np.ones((2, 2)))
    with pytest.raises(ValueError, match="exactly one"):
        LoadEstimator(1, 2)
    with pytest.raises(ValueError, match="ema=1.5"):
        LoadEstimator(1, 2, ema=1.5)


def test_replicas_share_tokens_evenly_and_deterministically():
    load = np.array([[100.0, 1, 1, 1, 1, 1, 1, 1]])
    plan = rebalance(load, 12, 1, 1, 4)
    hot_slots = plan.log2phy[0, 0][plan.log2phy[0, 0] >= 0]
    assert hot_slots.size == 4  # capped at one replica per GPU
    rng = np.random.default_rng(0)
    experts = rng.choice(8, size=(97, 2), p=load[0] / load.sum())
    tokens = np.arange(97)[:, None]
    slots = replica_for_tokens(plan, 0, experts, tokens)
    assert slots.shape == experts.shape
    np.testing.assert_array_equal(plan.phy2log[0, slots], experts)
    counts = np.bincount(slots[experts == 0], minlength=12)[hot_slots]
    assert counts.max() - counts.min() <= 1
    np.testing.assert_array_equal(slots, replica_for_tokens(plan, 0, experts, tokens))


def test_global_token_ids_spread_ranks_over_replicas():
    plan = rebalance(np.array([[50.0, 1, 1, 1]]), 8, 1, 1, 4)
    # four ranks each route one token to expert 0: with global ids they pick different replicas
    picks = [
        int(replica_for_tokens(plan, 0, np.array([0]), np.array([rank]))[0]) for rank in range(4)
    ]
    assert len(set(picks)) == min(4, int(plan.logcnt[0, 0]))


def test_dispatch_torch_and_errors():
    plan = rebalance(np.ones((1, 4)), 8, 1, 1, 4)
    out = replica_for_tokens(plan, 0, torch.tensor([[0, 1], [2, 3]]), torch.arange(2)[:, None])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64
    with pytest.raises(ValueError, match="expert_ids must be in"):
        replica_for_tokens(plan, 0, np.array([4]), np.array([0]))
    with pytest.raises(ValueError, match="layer=1"):
        replica_for_tokens(plan, 1, np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="must hold integers"):
        replica_for_tokens(plan, 0, np.array([0.5]), np.array([0]))
