"""DeepEP's normal kernels as two link stages (RDMA, then NVLink), derived from its published figures."""

from __future__ import annotations

from dataclasses import replace
from math import comb

import pytest

from moeinfra.errors import InputError
from moeinfra.serving.deepep import (
    DEEPEP_LL_H100_8_NODES_US,
    DEEPEP_NORMAL_H800_GB_PER_S,
    TEST_NIC_GB_PER_S,
    TEST_NVLINK_GB_PER_S,
    bench_routing_fanout,
    derived_efficiency,
    ll_fixed_share,
    normal_seconds_per_row,
    stage_rates,
)
from moeinfra.serving.perfmodel import COMBINE_BYTES_PER_TOKEN, DISPATCH_BYTES_PER_TOKEN, PerfModel
from moeinfra.serving.specs import HARDWARE, Deployment, fitting_redundant_experts


def _uniform_distinct(places: int, experts: int = 256, topk: int = 8) -> float:
    """Expected distinct places among ``topk`` experts drawn without replacement, experts spread
    evenly over ``places`` (DeepEP's test routing when every node group is chosen)."""
    per_place = experts // places
    return places * (1 - comb(experts - per_place, topk) / comb(experts, topk))


@pytest.mark.parametrize("nodes", [2, 4])
def test_fanout_of_deepeps_routing_matches_the_exact_expectation(nodes):
    # up to 4 nodes every node group is chosen, so the top-8 are a uniform draw of 8 of 256
    # (__wrapped__: computed here, not taken from the cache filled at import)
    nodes_per_token, gpus_per_token = bench_routing_fanout.__wrapped__(nodes)
    assert nodes_per_token == pytest.approx(_uniform_distinct(nodes), rel=0.01)
    assert gpus_per_token == pytest.approx(_uniform_distinct(nodes * 8), rel=0.01)


def test_fanout_with_node_limited_routing_reaches_at_most_four_nodes():
    nodes_per_token, gpus_per_token = bench_routing_fanout.__wrapped__(8)
    # 4 of 8 nodes chosen, each chosen node's best expert ranks high: close to 4 nodes
    assert 3.9 < nodes_per_token <= 4.0
    assert nodes_per_token < gpus_per_token <= 8.0


def test_links_carry_the_published_logical_bandwidth_converted():
    rates = stage_rates()
    (nic16, nvl16), (nic32, _), (nic64, _) = rates[16], rates[32], rates[64]
    # logical bytes count the sender's own node: the NIC carried (N - 1) / N of them
    assert nic16 == pytest.approx((43.0 / 2, 43.0 / 2))
    assert nic32 == pytest.approx((58.0 * 3 / 4, 57.0 * 3 / 4))
    assert nic64 == pytest.approx((51.0 * 7 / 8, 50.0 * 7 / 8))
    npt, gpt = bench_routing_fanout(2)
    assert nvl16[0] == pytest.approx(43.0 * gpt / npt)
    # EP16 moved far less over the NIC than EP32 / EP64 did: it was held back by NVLink
    assert nic16[0] < 0.5 * min(nic32[0], nic64[0])


def test_efficiencies_are_the_fastest_rate_each_link_reached():
    assert derived_efficiency.__wrapped__() == derived_efficiency()
    (nic_d, nic_c), (nvl_d, nvl_c) = derived_efficiency()
    assert nic_d == pytest.approx(51.0 * 7 / 8 / TEST_NIC_GB_PER_S)  # EP64 dispatch
    assert nic_c == pytest.approx(50.0 * 7 / 8 / TEST_NIC_GB_PER_S)
    npt, gpt = bench_routing_fanout(2)
    assert nvl_d == pytest.approx(43.0 * gpt / npt / TEST_NVLINK_GB_PER_S)  # EP16
    assert 0.8 < nic_d < 0.95 and 0.8 < nvl_d < 0.95  # physical: below the link's peak


@pytest.mark.parametrize("ep", sorted(DEEPEP_NORMAL_H800_GB_PER_S))
def test_two_stage_kernel_reproduces_every_published_point(ep):
    """The longer of the two stages, under the benchmark's own routing, gives back each published
    logical bandwidth: EP16 (NVLink-bound) and EP64 (RDMA-bound), which set the two efficiencies,
    by construction; EP32, which sets neither, within 3% (the check)."""
    nodes = ep // 8
    npt, gpt = bench_routing_fanout(nodes)
    (nic_eff, nvl_eff) = derived_efficiency()
    for i, row_bytes in enumerate((DISPATCH_BYTES_PER_TOKEN, COMBINE_BYTES_PER_TOKEN)):
        seconds = normal_seconds_per_row(
            nodes, npt, gpt, row_bytes, TEST_NIC_GB_PER_S, TEST_NVLINK_GB_PER_S,
            nic_eff[i], nvl_eff[i],
        )  # fmt: skip
        logical = npt * row_bytes / seconds / 1e9
        assert logical == pytest.approx(DEEPEP_NORMAL_H800_GB_PER_S[ep][i], rel=0.03)


def test_stage_bound_switches_with_the_nvlink_speed():
    npt, gpt = bench_routing_fanout(2)
    (nic_eff, nvl_eff) = derived_efficiency()

    def logical(nvlink_gb_per_s):
        s = normal_seconds_per_row(
            2, npt, gpt, DISPATCH_BYTES_PER_TOKEN, 50.0, nvlink_gb_per_s, nic_eff[0], nvl_eff[0]
        )
        return npt * DISPATCH_BYTES_PER_TOKEN / s / 1e9

    # on H100's NVLink the 2-node kernel is RDMA-bound: the NIC at its EP64 rate, ~89 GB/s logical
    assert logical(450.0) == pytest.approx(51.0 * 7 / 8 * npt / (npt / 2), rel=1e-9)
    assert 85 < logical(450.0) < 92
    assert logical(160.0) == pytest.approx(43.0)
    assert logical(1e6) == logical(450.0)  # more NVLink no longer helps


def _prefill(hw: str, nodes: int, micro_batches: int = 2):
    dep = Deployment(
        "prefill",
        nodes=nodes,
        micro_batches=micro_batches,
        redundant_experts=fitting_redundant_experts(nodes),
    )
    return PerfModel(dep, HARDWARE[hw]).prefill_breakdown()


def test_h100_and_h800_differ_where_nvlink_binds():
    # 2 nodes: H800's NVLink forward binds, H100's does not -> half the all-to-all time
    h800, h100 = _prefill("h800", 2), _prefill("h100", 2)
    assert h100.comm.sum() == pytest.approx(h800.comm.sum() * 0.496, rel=0.02)
    # ... hidden behind compute with two micro-batches (but for the SMs it holds while it runs:
    # the attention beside the shorter combine gets them back sooner), exposed with one
    assert 0.96 * h800.step_s < h100.step_s < h800.step_s
    assert _prefill("h100", 2, 1).step_s < 0.85 * _prefill("h800", 2, 1).step_s
    # 4 nodes: RDMA-bound on both, the same
    assert _prefill("h100", 4).comm.sum() == pytest.approx(_prefill("h800", 4).comm.sum())


def test_a_faster_nic_shortens_only_the_rdma_stage():
    base = HARDWARE["h800"]
    fast_nic = replace(base, name="h800-2nic", rdma_gb_per_s=100.0)
    dep = Deployment("prefill", nodes=4)
    slow, fast = PerfModel(dep, base), PerfModel(dep, fast_nic)
    s, f = slow.prefill_breakdown(), fast.prefill_breakdown()
    # EP32 on H800 is RDMA-bound: twice the NIC is faster, but NVLink now binds, not half
    assert 0.5 * s.comm.sum() < f.comm.sum() < 0.95 * s.comm.sum()


def test_low_latency_fixed_share_is_a_line_through_the_two_measured_points():
    # dispatch 45.73 us at 16 tokens and 166.77 at 128: slope 1.0807 us per token, 28.44 at 0
    dispatch, combine = ll_fixed_share(DEEPEP_LL_H100_8_NODES_US)
    assert dispatch == pytest.approx((45.73 - 16 * (166.77 - 45.73) / 112) / 166.77)
    assert combine == pytest.approx((59.57 - 16 * (304.73 - 59.57) / 112) / 304.73)
    # any two points on t = 10 + t_per_token * n keep 10 / t(128)
    assert ll_fixed_share({32: (14.0, 26.0), 64: (18.0, 42.0)}) == pytest.approx(
        (10.0 / 26.0, 10.0 / 74.0)
    )


def test_the_benchmark_routing_needs_experts_that_split_over_the_gpus():
    with pytest.raises(InputError, match="nodes=3: 256 experts do not split over 3 x 8 GPUs"):
        bench_routing_fanout.__wrapped__(3)
