"""DeepEP's published normal-kernel bandwidths (H800) and the two link efficiencies derived from them.

DeepEP's normal (internode) kernels move a token in two stages: over RDMA once to each destination
node (to the GPU with the sender's local index), then over NVLink from there to each destination
GPU of that node. The published figures (README, 2025-02: H800, ~160 GB/s NVLink, one 50 GB/s CX7
NIC per GPU) are *logical* RDMA bandwidths: bytes x destination nodes per token, the sender's own
node included, over the kernel's time (``num_rdma_token_sent`` in DeepEP's
``tests/legacy/test_internode.py``; the later README says so: "logical bandwidth ... contains local
rank traffic"), measured on 4,096 tokens per GPU routed at random over ``min(nodes, 4)`` node
groups, top-8 of 256 experts.

From a point at ``N`` nodes: the bytes that crossed the NIC were ``(N - 1) / N`` of the logical ones
(every node is as likely to be reached, the own node among them), and the bytes each GPU received
over NVLink were ``gpus_per_token / nodes_per_token`` times the logical ones (one row per
destination GPU, DeepEP's ``nvl_recv_bytes``), both fan-outs under the test's routing
(:func:`bench_routing_fanout`). A link's efficiency is the fastest it was seen going
(:func:`derived_efficiency`): the NIC at 8 nodes (44.6 of 50 GB/s; 43.5 at 4 nodes, and EP16's
21.5 far below both) and NVLink at 2 nodes (140 of 160 GB/s). A kernel then takes the
longer of its two stages, which gives back the EP16 and EP64 figures (they set the efficiencies)
and predicts EP32's within 3% (``tests/serving/test_deepep.py``), and says where a faster NVLink (H100's 450 GB/s) helps:
at 2 nodes, where H800's NVLink is the bottleneck.

DeepEP's low-latency kernels are published at 128 tokens per GPU only. How their time falls with
fewer tokens comes from DeepEP's own kernels measured at 16 and 128 tokens per GPU on 8 H100 nodes
by NVIDIA's AIConfigurator (:data:`DEEPEP_LL_H100_8_NODES_US`): a line through the two points keeps
0.17 (dispatch) and 0.08 (combine) of the 128-token time at 0 tokens (:func:`ll_fixed_share`); the
2- and 4-node points, not used, test it (``tests/serving/test_against_aiconfigurator.py``).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from moeinfra.errors import InputError

#: DeepEP normal kernels on H800, logical RDMA GB/s (dispatch FP8, combine BF16) by EP degree.
DEEPEP_NORMAL_H800_GB_PER_S: dict[int, tuple[float, float]] = {
    16: (43.0, 43.0),
    32: (58.0, 57.0),
    64: (51.0, 50.0),
}
#: The links of DeepEP's test machines (README): one CX7 400 Gb/s NIC per GPU, H800 NVLink.
TEST_NIC_GB_PER_S = 50.0
TEST_NVLINK_GB_PER_S = 160.0
TEST_GPUS_PER_NODE = 8

#: DeepEP low-latency dispatch and combine (µs) on 8 H100 nodes (EP64), DeepSeek-V3 shapes, by
#: tokens per GPU: NVIDIA AIConfigurator 0.12.0 (``aiconfigurator-core``, Apache-2.0),
#: ``systems/data/h100_sxm/comm/sglang/0.5.6.post2/wideep_deepep_ll_perf.parquet``.
DEEPEP_LL_H100_8_NODES_US: dict[int, tuple[float, float]] = {
    16: (45.73, 59.57),
    128: (166.77, 304.73),
}


@cache
def bench_routing_fanout(
    nodes: int,
    gpus_per_node: int = TEST_GPUS_PER_NODE,
    experts: int = 256,
    topk: int = 8,
    tokens: int = 4096,
    seed: int = 0,
) -> tuple[float, float]:
    """Mean distinct (nodes, GPUs) a token reaches under DeepEP's test routing: scores
    ``|N(0, 1)| + 1`` per expert, the ``min(nodes, 4)`` nodes with the highest expert score, the
    top ``topk`` experts among them (one node = one group), on ``tokens`` seeded tokens. The
    experts must split evenly over the nodes' GPUs (DeepEP's test: 2, 4 or 8 nodes of 8)."""
    if experts % (nodes * gpus_per_node):
        raise InputError(
            f"nodes={nodes}: {experts} experts do not split over {nodes} x {gpus_per_node} GPUs"
        )
    rng = np.random.default_rng(seed)
    scores = np.abs(rng.standard_normal((tokens, experts))) + 1.0
    per_node = experts // nodes
    groups = min(nodes, 4)
    node_best = scores.reshape(tokens, nodes, per_node).max(axis=2)
    chosen = np.argpartition(-node_best, groups - 1, axis=1)[:, :groups]
    allowed = np.zeros((tokens, nodes), dtype=bool)
    np.put_along_axis(allowed, chosen, True, axis=1)
    masked = np.where(np.repeat(allowed, per_node, axis=1), scores, 0.0)
    top = np.argpartition(-masked, topk - 1, axis=1)[:, :topk]

    def distinct(places: np.ndarray) -> float:
        ordered = np.sort(places, axis=1)
        return float(1.0 + (np.diff(ordered, axis=1) > 0).sum(axis=1).mean())

    return distinct(top // per_node), distinct(top // (experts // (nodes * gpus_per_node)))


def stage_rates(
    published: dict[int, tuple[float, float]] = DEEPEP_NORMAL_H800_GB_PER_S,
) -> dict[int, tuple[tuple[float, float], tuple[float, float]]]:
    """Per EP degree: ((NIC dispatch, combine), (NVLink dispatch, combine)) GB/s each link carried."""
    out = {}
    for ep, logical in published.items():
        nodes = ep // TEST_GPUS_PER_NODE
        nodes_per_token, gpus_per_token = bench_routing_fanout(nodes)
        nic = tuple(v * (nodes - 1) / nodes for v in logical)
        nvlink = tuple(v * gpus_per_token / nodes_per_token for v in logical)
        out[ep] = (nic, nvlink)
    return out


@cache
def derived_efficiency() -> tuple[tuple[float, float], tuple[float, float]]:
    """((NIC dispatch, combine), (NVLink dispatch, combine)) efficiencies of the normal kernels:
    the fastest each link carried at any published point, over the test machine's link speed."""
    rates = stage_rates().values()
    nic = tuple(max(r[0][i] for r in rates) / TEST_NIC_GB_PER_S for i in (0, 1))
    nvlink = tuple(max(r[1][i] for r in rates) / TEST_NVLINK_GB_PER_S for i in (0, 1))
    return nic, nvlink  # type: ignore[return-value]


def normal_seconds_per_row(
    nodes: int,
    nodes_per_token: float,
    gpus_per_token: float,
    row_bytes: float,
    nic_gb_per_s: float,
    nvlink_gb_per_s: float,
    nic_efficiency: float,
    nvlink_efficiency: float,
) -> float:
    """Seconds per token a GPU sends (or, combining, gets back) through a normal kernel: the
    longer of its remote rows over the NIC and its rows over NVLink at the destination nodes."""
    nic = nodes_per_token * (1.0 - 1.0 / nodes) * row_bytes / (nic_gb_per_s * 1e9 * nic_efficiency)
    nvlink = gpus_per_token * row_bytes / (nvlink_gb_per_s * 1e9 * nvlink_efficiency)
    return max(nic, nvlink)


def ll_fixed_share(
    points: dict[int, tuple[float, float]] = DEEPEP_LL_H100_8_NODES_US,
) -> tuple[float, float]:
    """(dispatch, combine) share of a low-latency kernel's 128-token time that does not shrink with
    fewer tokens: the time at 0 tokens of a line through the two measured points."""
    (n0, t0), (n1, t1) = sorted(points.items())
    shares = []
    for i in (0, 1):
        slope = (t1[i] - t0[i]) / (n1 - n0)
        fixed = t0[i] - slope * n0
        shares.append(fixed / (fixed + slope * 128))
    return shares[0], shares[1]
