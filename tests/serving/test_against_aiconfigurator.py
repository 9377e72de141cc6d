"""The model's kernels against NVIDIA AIConfigurator's measured H100 latencies (SGLang, DeepEP,
DeepSeek-V3 shapes; tests/serving/data/aiconfigurator_h100_sglang.json): the error bands
docs/serving-model.md ("Against AIConfigurator's measured kernels") states, where it agrees and
where it does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.specs import HARDWARE, Deployment, fitting_redundant_experts

MEASURED = json.loads(
    (Path(__file__).parent / "data" / "aiconfigurator_h100_sglang.json").read_text()
)


def _unit(phase: str, nodes: int) -> PerfModel:
    dep = Deployment(phase, nodes=nodes, redundant_experts=fitting_redundant_experts(nodes))
    return PerfModel(dep, HARDWARE[MEASURED["hardware"]])


def _all_to_all_ratios(kernel: str, phase: str) -> dict[tuple[int, int], tuple[float, float]]:
    out = {}
    for row in MEASURED[kernel]:
        dispatch, combine = _unit(phase, row["nodes"]).all_to_all_s(row["tokens_per_gpu"])
        out[row["nodes"], row["tokens_per_gpu"]] = (
            dispatch * 1e3 / row["dispatch_ms"],
            combine * 1e3 / row["combine_ms"],
        )
    return out


def test_normal_all_to_all_within_ten_percent_where_one_link_binds_alike():
    ratios = _all_to_all_ratios("deepep_normal", "prefill")
    for nodes in (1, 4):  # NVLink only; RDMA-bound at 4 nodes
        for tokens in (4096, 16384):
            assert ratios[nodes, tokens] == pytest.approx((1.0, 1.0), abs=0.10), (nodes, tokens)
    # 2 nodes: RDMA-bound on H100 in the model, up to 28% faster than measured
    for tokens in (4096, 16384):
        assert all(0.70 <= r <= 0.97 for r in ratios[2, tokens]), ratios[2, tokens]
    # 8 nodes: the measured kernel is 2.7x slower than any link bound (notify alone up to 16 ms)
    for tokens in (4096, 16384):
        assert all(0.33 <= r <= 0.40 for r in ratios[8, tokens]), ratios[8, tokens]


def test_low_latency_all_to_all_within_twenty_percent_at_every_size():
    """The fixed share comes from the 8-node points at 16 and 128 tokens; the 2- and 4-node points
    and the other sizes are not used by the model."""
    ratios = _all_to_all_ratios("deepep_low_latency", "decode")
    assert len(ratios) == 12
    for (nodes, tokens), (dispatch, combine) in ratios.items():
        assert 0.80 <= combine <= 1.15, (nodes, tokens, combine)
        assert 1.0 <= dispatch <= 1.20, (nodes, tokens, dispatch)


def test_prefill_expert_gemms_are_the_models_largest_optimism():
    """DeepGEMM's published grouped-GEMM rate (kernel only) against SGLang's whole MoE block
    (activation quantisation, SiLU, layout included): the model is 1.5x (EP32) to 2x (EP64) fast,
    about the GEMM factor the shipped calibrations fit (x1.21, x1.42)."""
    for row in MEASURED["moe_prefill"]:
        ratio = _unit("prefill", row["ep"] // 8).routed_experts_s(row["tokens_per_gpu"]) * 1e3
        ratio /= row["ms"]
        band = (0.60, 0.70) if row["ep"] == 32 else (0.45, 0.55)
        assert band[0] <= ratio <= band[1], (row, ratio)


def test_decode_expert_gemms_within_fifteen_percent():
    for row in MEASURED["moe_decode"]:
        ratio = _unit("decode", row["ep"] // 8).routed_experts_s(row["tokens_per_gpu"]) * 1e3
        assert 1.0 <= ratio / row["ms"] <= 1.16, (row, ratio / row["ms"])
