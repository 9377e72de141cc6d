import numpy as np
import pytest
import torch

from moeinfra.eplb import rebalance_experts
from moeinfra.eplb.deepseek import balanced_packing
from moeinfra.eplb.published import EXAMPLE_PHY2LOG, EXAMPLE_WEIGHT


def test_published_readme_example_exact():
    phy2log, log2phy, logcnt = rebalance_experts(EXAMPLE_WEIGHT, 16, 4, 2, 8)
    np.testing.assert_array_equal(phy2log, EXAMPLE_PHY2LOG)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == np.int64
    # as DeepSeek's release: as wide as the most replicas any expert got (logcnt.max() = 2 here)
    assert log2phy.shape == (2, 12, int(logcnt.max())) == (2, 12, 2)
    _, wide, _ = rebalance_experts(EXAMPLE_WEIGHT, 16, 4, 2, 8, log2phy_width="max")
    assert wide.shape == (2, 12, 16 - 12 + 1)  # vLLM's width
    np.testing.assert_array_equal(wide[..., :2], log2phy)
    assert (wide[..., 2:] == -1).all()
    with pytest.raises(ValueError, match="log2phy_width='x'"):
        rebalance_experts(EXAMPLE_WEIGHT, 16, 4, 2, 8, log2phy_width="x")
    np.testing.assert_array_equal(logcnt.sum(axis=1), [16, 16])


def test_torch_in_torch_out():
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor(EXAMPLE_WEIGHT), 16, 4, 2, 8)
    assert isinstance(phy2log, torch.Tensor) and isinstance(log2phy, torch.Tensor)
    assert phy2log.dtype == torch.int64 and logcnt.device.type == "cpu"
    np.testing.assert_array_equal(phy2log.numpy(), EXAMPLE_PHY2LOG)


def _reference_packing(weight, num_packs):
    """Straight transcription of the rule in REFERENCE.md: descending items, lightest non-full pack."""
    rows, items = weight.shape
    per_pack = items // num_packs
    pack_index = np.full((rows, items), -1)
    rank = np.full((rows, items), -1)
    for row in range(rows):
        loads = [np.float32(0)] * num_packs
        sizes = [0] * num_packs
        for item in sorted(range(items), key=lambda i: -weight[row, i]):
            pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=lambda p: loads[p])
            pack_index[row, item] = pack
            rank[row, item] = sizes[pack]
            loads[pack] += weight[row, item]
            sizes[pack] += 1
    return pack_index, rank


@pytest.mark.parametrize("items,packs", [(12, 4), (72, 8), (288, 32), (16, 8)])
def test_vectorised_packing_matches_the_rule(items, packs):
    rng = np.random.default_rng(items)
    weight = rng.lognormal(0, 1, (6, items)).astype(np.float32)
    got = balanced_packing(weight, packs)
    want = _reference_packing(weight, packs)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_global_policy_used_when_groups_do_not_divide_nodes():
    weight = np.random.default_rng(0).integers(1, 100, (3, 16))
    phy2log, _, logcnt = rebalance_experts(weight, 24, 4, 3, 6)  # 4 % 3 != 0 -> global
    same, _, _ = rebalance_experts(weight, 24, 1, 1, 6)
    np.testing.assert_array_equal(phy2log, same)
    assert (logcnt >= 1).all()


@pytest.mark.parametrize(
    "args,message",
    [
        ((15, 4, 2, 8), "multiple of num_gpus"),
        ((8, 4, 2, 8), "must be >= the number of experts"),
        # hierarchical (groups % nodes == 0) needs what the reference asserts; the global fallback
        # does not (tests/eplb/test_deepseek_scale.py)
        ((16, 8, 2, 8), "num_groups=8 must divide"),
        ((24, 4, 4, 6), "num_gpus=6 must be a multiple of num_nodes=4"),
        ((16, 4, 2, 0), "num_gpus=0 must be a positive integer"),
    ],
)
def test_bad_layout_is_rejected_with_the_rule(args, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(EXAMPLE_WEIGHT, *args)


@pytest.mark.parametrize(
    "weight,message",
    [
        (np.ones(12), r"shape \[layers, experts\]"),
        (np.full((2, 12), np.nan), "finite"),
        (-np.ones((2, 12)), ">= 0"),
        (np.ones((0, 12)), "at least one layer"),
    ],
)
def test_bad_weight_is_rejected(weight, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(weight, 16, 4, 2, 8)
