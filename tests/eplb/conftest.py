import numpy as np
import pytest

from moeinfra.eplb.synthetic import synthetic_load

PREFILL = {"num_replicas": 288, "num_groups": 8, "num_nodes": 4, "num_gpus": 32}
DECODE = {"num_replicas": 288, "num_groups": 8, "num_nodes": 18, "num_gpus": 144}


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


def pytest_collection_modifyitems(items):
    """Tests at DeepSeek-V3 scale take seconds each with interpreted kernels: marked ``slow``, so
    ``make mutate`` (``-m "not slow"``) runs each mutant against the small, exact cases."""
    for item in items:
        if "v3_loads" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
