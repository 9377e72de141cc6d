"""The model's kernels against NVIDIA AIConfigurator's measured H100 latencies (SGLang, DeepEP,
DeepSeek-V3 shapes; rows copied from its tables into tests/serving/data/aiconfigurator_h100_rows.json):
the error bands docs/serving-model.md ("Against AIConfigurator's measured kernels") states, where
it agrees and where it does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeinfra.serving.kernels import KernelTables
from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.specs import DEEPSEEK_V3, HARDWARE, Deployment, fitting_redundant_experts

ROWS = json.loads((Path(__file__).parent / "data" / "aiconfigurator_h100_rows.json").read_text())
TABLES = KernelTables(ROWS["system"], ROWS["rows"])
SHAPE = {"hidden": 7168, "topk": 8, "experts": 256, "inter": 2048}


def _unit(phase: str, nodes: int) -> PerfModel:
    dep = Deployment(phase, nodes=nodes, redundant_experts=fitting_redundant_experts(nodes))
    return PerfModel(dep, HARDWARE["h100"], DEEPSEEK_V3)


def _all_to_all_ratios(kernel: str, phase: str) -> dict[tuple[int, int], tuple[float, float]]:
    out = {}
    for nodes in (1, 2, 4, 8):
        curves = TABLES.all_to_all(kernel, nodes, SHAPE)
        if curves is None:
            continue
        dispatch_curve, combine_curve = curves
        for i, tokens in enumerate(dispatch_curve.tokens):
            dispatch, combine = _unit(phase, nodes).all_to_all_s(tokens)
            out[nodes, int(tokens)] = (
                dispatch / dispatch_curve.seconds[i],
                combine / combine_curve.seconds[i],
            )
    return out


def _routed_ratios(phase: str) -> dict[tuple[int, int], float]:
    out = {}
    for ep in (32, 64):
        curve = TABLES.routed_experts(phase, ep, SHAPE)
        for tokens, seconds in zip(curve.tokens, curve.seconds, strict=True):
            out[ep, int(tokens)] = _unit(phase, ep // 8).routed_experts_s(tokens) / seconds
    return out


def test_normal_all_to_all_within_ten_percent_where_one_link_binds_alike():
    ratios = _all_to_all_ratios("normal", "prefill")
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
    ratios = _all_to_all_ratios("low_latency", "decode")
    assert len(ratios) == 12
    for (nodes, tokens), (dispatch, combine) in ratios.items():
        assert 0.80 <= combine <= 1.15, (nodes, tokens, combine)
        assert 1.0 <= dispatch <= 1.20, (nodes, tokens, dispatch)


def test_prefill_expert_gemms_are_the_models_largest_optimism():
    """DeepGEMM's published grouped-GEMM rate (kernel only) against SGLang's whole MoE block
    (activation quantisation, SiLU, layout included): the model is 1.5x (EP32) to 2x (EP64) fast,
    about the GEMM factor the shipped calibrations fit (x1.21, x1.42)."""
    ratios = _routed_ratios("prefill")
    assert len(ratios) == 6
    for (ep, tokens), ratio in ratios.items():
        band = (0.60, 0.70) if ep == 32 else (0.45, 0.55)
        assert band[0] <= ratio <= band[1], (ep, tokens, ratio)


def test_decode_expert_gemms_within_fifteen_percent():
    ratios = _routed_ratios("decode")
    assert len(ratios) == 5
    for (ep, tokens), ratio in ratios.items():
        assert 1.0 <= ratio <= 1.16, (ep, tokens, ratio)
