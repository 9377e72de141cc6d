import numpy as np
import pytest

from moeinfra.eplb.synthetic import synthetic_load

PREFILL = {"num_replicas": 288, "num_groups": 8, "num_nodes": 4, "num_gpus": 32}
DECODE = {"num_replicas": 288, "num_groups": 8, "num_nodes": 18, "num_gpus": 144}

EXAMPLE_WEIGHT = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
EXAMPLE_PHY2LOG = np.array(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


@pytest.fixture(scope="session")
def v3_loads():
    """Seeded skewed loads at DeepSeek-V3 scale: {(kind, seed): [58, 256]}."""
    return {
        (kind, seed): synthetic_load(kind, 58, 256, seed=seed)
        for kind in ("lognormal", "zipf")
        for seed in (0, 1)
    }


def check_plan_invariants(plan, num_experts):
    """Every invariant a plan must hold, whatever the policy."""
    lay = plan.layout
    layers = plan.phy2log.shape[0]
    assert plan.phy2log.shape == (layers, lay.num_replicas)
    assert plan.phy2log.dtype == np.int64
    assert plan.phy2log.min() >= 0 and plan.phy2log.max() < num_experts
    for layer in range(layers):
        counts = np.bincount(plan.phy2log[layer], minlength=num_experts)
        assert (counts >= 1).all(), "every expert needs a replica"
        np.testing.assert_array_equal(plan.logcnt[layer], counts)
        for expert in range(num_experts):
            slots = plan.log2phy[layer, expert]
            real = slots[slots >= 0]
            assert real.size == counts[expert]
            assert (slots[real.size :] == -1).all(), "padding comes after the real slots"
            assert (plan.phy2log[layer, real] == expert).all()
    assert plan.gpu_load.shape == (layers, lay.num_gpus)
