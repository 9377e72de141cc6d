import numpy as np
import pytest
import torch

from moeinfra.eplb import POLICIES, evaluate, rebalance
from moeinfra.eplb.local_search import duplicate_slots
from moeinfra.eplb.published import EXAMPLE_WEIGHT

from .conftest import DECODE, PREFILL, check_plan_invariants


@pytest.mark.parametrize("policy", POLICIES)
def test_invariants_on_the_example(policy):
    plan = rebalance(EXAMPLE_WEIGHT, 16, 4, 2, 8, policy=policy)
    check_plan_invariants(plan, 12)
    assert plan.policy == policy


@pytest.mark.parametrize("shape", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("policy", ["auto", "global"])
def test_never_worse_than_deepseek_at_v3_scale(v3_loads, shape, policy):
    for load in v3_loads.values():
        ours = rebalance(load, **shape, policy=policy)
        check_plan_invariants(ours, 256)
        # "deepseek" policy of the same kind the forced policy is compared against
        if policy == "auto":
            theirs = rebalance(load, **shape, policy="deepseek")
        else:
            theirs = rebalance(
                load, **{**shape, "num_groups": 1, "num_nodes": 1}, policy="deepseek"
            )
        ours_max = ours.gpu_load.max(axis=1)
        theirs_max = theirs.gpu_load.max(axis=1)
        assert (ours_max <= theirs_max * (1 + 1e-12)).all()


def test_hierarchical_never_worse_than_deepseek_and_keeps_nodes(v3_loads):
    for load in v3_loads.values():
        ours = rebalance(load, **PREFILL, policy="hierarchical")
        theirs = rebalance(load, **PREFILL, policy="deepseek")
        assert (ours.gpu_load.max(axis=1) <= theirs.gpu_load.max(axis=1) * (1 + 1e-12)).all()
        # every expert group stays on one node (what makes group-limited routing cheap)
        slot_node = np.arange(288) // 72
        group = ours.phy2log // 32
        for layer in range(load.shape[0]):
            for g in range(8):
                assert np.unique(slot_node[group[layer] == g]).size == 1


def test_default_is_within_one_percent_of_the_bound_on_prefill(v3_loads):
    for load in v3_loads.values():
        evaluation = evaluate(rebalance(load, **PREFILL), load)
        assert evaluation.gap.mean() <= 0.01
        assert evaluation.duplicates.sum() == 0


ONE_NODE = {"num_replicas": 288, "num_groups": 8, "num_nodes": 1, "num_gpus": 8}


@pytest.mark.parametrize("shape", [PREFILL, DECODE, ONE_NODE], ids=["prefill", "decode", "ep8"])
def test_no_duplicates_on_a_gpu(v3_loads, shape):
    for load in v3_loads.values():
        plan = rebalance(load, **shape)
        assert not duplicate_slots(plan.phy2log, shape["num_gpus"]).any()


def test_all_zero_load_spreads_redundant_replicas():
    plan = rebalance(np.zeros((3, 64)), 96, 8, 2, 16)
    check_plan_invariants(plan, 64)
    assert plan.logcnt.max() == 2, (
        "32 redundant slots over 64 idle experts: at most 2 replicas each"
    )
    assert (plan.logcnt.sum(axis=1) == 96).all()


def test_auto_trades_balance_against_traffic(v3_loads):
    load = v3_loads[("lognormal", 0)]
    free_traffic = rebalance(load, **PREFILL, traffic_weight=0.0)
    costly_traffic = rebalance(load, **PREFILL, traffic_weight=5.0)
    assert set(free_traffic.metrics["layer_policy"]) == {"global"}
    assert set(costly_traffic.metrics["layer_policy"]) == {"hierarchical"}
    assert (
        evaluate(costly_traffic, load).nodes_per_token.mean()
        < evaluate(free_traffic, load).nodes_per_token.mean()
    )


def test_auto_uses_global_when_groups_do_not_divide_nodes(v3_loads):
    plan = rebalance(v3_loads[("zipf", 0)], **DECODE)
    assert set(plan.metrics["layer_policy"]) == {"global"}


def test_torch_load_accepted():
    plan = rebalance(torch.tensor(EXAMPLE_WEIGHT, dtype=torch.float32), 16, 4, 2, 8)
    check_plan_invariants(plan, 12)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"policy": "best"}, "policy='best' is not one of"),
        ({"max_moves": 4}, "needs a previous plan"),
        ({"tolerance": -1.0}, "tolerance=-1.0 must be a finite number >= 0"),
        ({"groups_per_token": 9}, "groups_per_token=9"),
    ],
)
def test_bad_options_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rebalance(EXAMPLE_WEIGHT, 16, 4, 2, 8, **kwargs)


def test_forced_hierarchical_needs_divisible_groups():
    with pytest.raises(ValueError, match="num_groups % num_nodes == 0"):
        rebalance(np.ones((1, 24)), 36, 4, 3, 6, policy="hierarchical")
