import itertools

import numpy as np
import pytest

from moeinfra.eplb import evaluate, lower_bound, rebalance
from moeinfra.eplb.inputs import check_layout
from moeinfra.eplb.plan import make_plan

from .conftest import PREFILL


def test_evaluate_known_values_on_a_hand_built_plan():
    # 4 experts, 6 slots on 2 GPUs (3 slots each) in 2 nodes, 2 groups of 2 experts.
    layout = check_layout(4, 6, 2, 2, 2)
    load = np.array([[60.0, 20.0, 10.0, 10.0]])
    phy2log = np.array([[0, 1, 2, 0, 3, 1]])  # GPU0: 0,1,2  GPU1: 0,3,1
    plan = make_plan(phy2log, load, layout, "hand")
    ev = evaluate(plan, load, groups_per_token=1, experts_per_token=1)
    # expert 0 and 1 have 2 replicas: slot loads 30,10,10 | 30,10,10
    np.testing.assert_allclose(ev.gpu_load, [[50.0, 50.0]])
    np.testing.assert_allclose(ev.balancedness, [1.0])
    np.testing.assert_allclose(ev.lower_bound, [50.0])
    assert ev.duplicates[0] == 0
    # experts 0,1 on both nodes (stay local), 2 and 3 on one node each: remote = (10+10)*0.5/100
    np.testing.assert_allclose(ev.remote_pair_fraction, [0.1])


def test_duplicates_counted():
    layout = check_layout(2, 4, 1, 1, 2)
    load = np.array([[3.0, 1.0]])
    plan = make_plan(np.array([[0, 0, 0, 1]]), load, layout, "hand")
    assert evaluate(plan, load).duplicates[0] == 1


def _brute_force_min_max(load, num_replicas, num_gpus):
    """Best max GPU load over every replica-count vector and every assignment (tiny cases)."""
    experts = load.size
    slots_per_gpu = num_replicas // num_gpus
    best = np.inf
    for extra in itertools.combinations_with_replacement(range(experts), num_replicas - experts):
        counts = np.ones(experts, dtype=int) + np.bincount(
            np.array(extra, dtype=int), minlength=experts
        )
        items = np.repeat(np.arange(experts), counts)
        per_item = load[items] / counts[items]
        for perm in set(itertools.permutations(range(len(items)))):
            gpu = np.add.reduceat(per_item[list(perm)], np.arange(0, len(items), slots_per_gpu))
            best = min(best, gpu.max())
    return best


@pytest.mark.parametrize("seed", range(5))
def test_lower_bound_is_below_the_true_optimum(seed):
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 20, 4).astype(float)
    bound = lower_bound(load[None, :], 6, 3)[0]
    assert bound <= _brute_force_min_max(load, 6, 3) + 1e-9


def test_lower_bound_never_above_any_plan(v3_loads):
    for load in v3_loads.values():
        for policy in ("auto", "deepseek", "hierarchical"):
            ev = evaluate(rebalance(load, **PREFILL, policy=policy), load)
            assert (ev.max_gpu_load >= ev.lower_bound * (1 - 1e-12)).all()


def test_hierarchical_reaches_at_most_groups_per_token_nodes(v3_loads):
    load = v3_loads[("zipf", 1)]
    hier = evaluate(rebalance(load, **PREFILL, policy="hierarchical"), load)
    glob = evaluate(rebalance(load, **PREFILL, policy="global"), load)
    assert (hier.nodes_per_token <= 4 + 1e-9).all()
    assert hier.nodes_per_token.mean() < glob.nodes_per_token.mean()


def test_summary_balancedness_is_ratio_of_sums():
    load = np.array([[4.0, 0.0], [1.0, 1.0]])
    plan = make_plan(np.array([[0, 1], [0, 1]]), load, check_layout(2, 2, 1, 1, 2), "hand")
    summary = evaluate(plan, load).summary()
    assert summary["balancedness"] == pytest.approx((2.0 + 1.0) / (4.0 + 1.0))


def test_load_shape_must_match_plan():
    plan = rebalance(np.ones((2, 12)), 16, 4, 2, 8)
    with pytest.raises(ValueError, match="does not match"):
        evaluate(plan, np.ones((3, 12)))


def test_gpus_per_token_counts_distinct_gpus_as_nodes_per_token_counts_nodes():
    # 4 equally loaded experts, one per GPU, 2 GPUs per node, one group, 2 experts per token:
    # a GPU is reached with probability 1 - (3/4)^2, a node with 1 - (1/2)^2
    load = np.ones((1, 4))
    plan = make_plan(np.array([[0, 1, 2, 3]]), load, check_layout(4, 4, 1, 2, 4), "hand")
    ev = evaluate(plan, load, groups_per_token=1, experts_per_token=2)
    assert ev.gpus_per_token[0] == pytest.approx(4 * (1 - 0.75**2))
    assert ev.nodes_per_token[0] == pytest.approx(2 * (1 - 0.5**2))
    assert ev.summary()["gpus_per_token"] == pytest.approx(1.75)


def test_gpus_per_token_is_nodes_per_token_with_one_gpu_per_node(v3_loads):
    load = v3_loads[("zipf", 1)]
    ev = evaluate(rebalance(load, 288, 8, 8, 8), load)
    assert ev.gpus_per_token == pytest.approx(ev.nodes_per_token)
    wide = evaluate(rebalance(load, **PREFILL), load)
    assert (wide.gpus_per_token >= wide.nodes_per_token).all()
