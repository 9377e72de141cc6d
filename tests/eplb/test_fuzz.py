import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moeinfra.eplb import evaluate, rebalance, rebalance_experts
from moeinfra.eplb.local_search import duplicate_slots

from .conftest import check_plan_invariants


@st.composite
def problems(draw):
    nodes = draw(st.integers(1, 3))
    gpus = nodes * draw(st.integers(1, 3))
    groups = draw(st.integers(1, 4))
    experts = groups * draw(st.integers(1, 4))
    slots_per_gpu = draw(st.integers(-(-experts // gpus), -(-experts // gpus) + 2))
    layers = draw(st.integers(1, 3))
    values = draw(
        st.lists(
            st.one_of(
                st.just(0.0), st.floats(0, 1e6, allow_nan=False), st.integers(0, 5).map(float)
            ),
            min_size=layers * experts,
            max_size=layers * experts,
        )
    )
    load = np.array(values).reshape(layers, experts)
    return load, slots_per_gpu * gpus, groups, nodes, gpus


@settings(max_examples=40, deadline=None)
@given(problems(), st.sampled_from(["auto", "global", "deepseek", "hierarchical"]))
def test_any_valid_problem_gives_a_valid_plan(problem, policy):
    load, replicas, groups, nodes, gpus = problem
    if policy == "hierarchical" and groups % nodes:
        return
    plan = rebalance(load, replicas, groups, nodes, gpus, policy=policy)
    check_plan_invariants(plan, load.shape[1])
    ev = evaluate(plan, load)
    assert (ev.max_gpu_load >= ev.lower_bound * (1 - 1e-9) - 1e-9).all()
    if policy in ("auto", "global"):
        phy2log, _, _ = rebalance_experts(load, replicas, groups, nodes, gpus)
        from moeinfra.eplb.plan import make_plan

        reference = make_plan(phy2log, load, plan.layout, "deepseek")
        if policy == "auto":
            assert (
                plan.gpu_load.max(axis=1) <= reference.gpu_load.max(axis=1) * (1 + 1e-9) + 1e-9
            ).all()
        # Duplicates survive only where the layer fell back to DeepSeek's own placement (no
        # duplicate-free placement found was as light), swap-improved: never more than DeepSeek's.
        ours = duplicate_slots(plan.phy2log, gpus).sum(axis=1)
        if policy == "auto" and replicas // gpus <= load.shape[1]:
            theirs = duplicate_slots(phy2log, gpus).sum(axis=1)
            assert (ours <= theirs).all()


def test_duplicates_only_where_deepseek_placement_is_kept_small_case():
    """Found by the fuzz test above: splitting the heavy expert packs worse (280) than DeepSeek's
    hierarchical plan (277), whose one-GPU nodes force a duplicate; spending the redundant slots
    on idle experts instead gives a duplicate-free 277."""
    load = np.array([[0.0] * 8, [0, 0, 0, 277.0, 51.0, 0, 0, 181.0]])
    plan = rebalance(load, 10, 4, 2, 2)
    phy2log, _, _ = rebalance_experts(load, 10, 4, 2, 2)
    assert not duplicate_slots(plan.phy2log, 2).any()
    assert plan.gpu_load[1].max() == 277.0
