"""Specs, performance model and cost model."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeinfra.errors import InputError
from moeinfra.serving.cost import R1_PRICES, Prices, fleet_cost_usd, margin, revenue_usd
from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.perfmodel.deepseek_v3 import mla_projections
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    HARDWARE,
    Deployment,
    ExpertBalance,
    deepseek_decode_unit,
    deepseek_prefill_unit,
    hardware,
)


@pytest.fixture(scope="module")
def units():
    hw = hardware("h800")
    return PerfModel(deepseek_prefill_unit(), hw), PerfModel(deepseek_decode_unit(), hw)


def test_deepseek_v3_shape():
    m = DEEPSEEK_V3
    assert m.num_moe_layers == 58
    assert m.kv_values_per_token_layer == 576
    assert 2 * m.kv_values_per_token_layer == 1_152  # bytes per token per layer (BF16)
    assert 36e9 < m.activated_params < 38e9  # "37B activated"


def test_presets_and_bad_names():
    assert set(HARDWARE) >= {"h800", "h100", "h200", "b200"}
    assert hardware("H800").fp8_tflops == 1979.0
    with pytest.raises(InputError, match="hardware='a100'"):
        hardware("a100")
    with pytest.raises(InputError, match="phase"):
        Deployment("train", 4)


def test_published_units_hold_9_and_2_experts_per_gpu(units):
    prefill, decode = units
    assert prefill.gpus == 32 and prefill.balance.slots_per_gpu == 9
    assert decode.gpus == 144 and decode.balance.slots_per_gpu == 2
    # EPLB can balance 9 slots per GPU almost perfectly; 2 per GPU cannot be
    assert prefill.balance.imbalance < 1.01 < decode.balance.imbalance


def test_slots_must_divide(units):
    with pytest.raises(InputError, match="multiple"):
        PerfModel(Deployment("decode", 18, redundant_experts=0), hardware("h800"))


def test_decode_step_grows_with_batch_and_kv(units):
    _, decode = units
    b = np.array([8, 32, 64, 128, 256], float)
    steps = decode.decode_step_s(b, 4096.0)
    assert np.all(np.diff(steps) > 0)
    assert np.all(np.diff(decode.decode_step_s(64.0, np.array([1e3, 4e3, 16e3]))) > 0)
    # throughput saturates: tokens/s per GPU rises with batch but sublinearly
    tput = b / steps
    assert np.all(np.diff(tput) > 0) and tput[-1] / tput[0] < b[-1] / b[0]


def test_vectorised_step_equals_breakdown(units):
    _, decode = units
    assert decode.decode_step_s(64.0, 4989.0) == pytest.approx(
        decode.decode_breakdown(64.0, 4989.0).step_s, rel=1e-9
    )


def test_layer_is_max_of_paths_plus_exposed(units):
    for b in (units[0].prefill_breakdown(), units[1].decode_breakdown(100.0, 5000.0)):
        assert np.all(b.layer >= np.maximum(b.compute, b.comm) - 1e-15)
        assert np.all(b.layer <= b.compute + b.comm + 1e-15)


def test_decode_memory_bound_core_attention(units):
    """Decode core attention reads the compressed KV: 1,152 bytes per token per layer."""
    _, decode = units
    b = decode.decode_breakdown(64.0, 4096.0)
    kv_bytes = 64 * 4096 * 1152
    floor = kv_bytes / (3.35e12 * decode.eff.memory)
    assert b.parts["core_attn"][10] >= floor * (1 - 1e-9)


def test_capacity_exceeds_published_per_node_throughput(units):
    """The per-node figures DeepSeek published are below the model's capacity (not capped by it)."""
    prefill, decode = units
    hit = 342 / 608
    per_node = 1 / prefill.prefill_seconds_per_token(hit, 3909) / prefill.dep.nodes / (1 - hit)
    assert per_node > 73.7e3
    assert 128 * decode.gpus / decode.decode_step_s(128, 4989) / decode.dep.nodes > 14.8e3


def test_faster_hardware_is_faster():
    times = {
        name: PerfModel(deepseek_decode_unit(), hardware(name)).decode_step_s(64, 4096)
        for name in ("h800", "h200", "b200")
    }
    assert times["b200"] < times["h200"] < times["h800"]


def test_kv_capacity_positive_and_weights_fit(units):
    _, decode = units
    assert decode.weight_bytes_per_gpu < 80e9
    assert decode.kv_capacity_tokens_per_gpu > 100_000


def test_cost_model_matches_published_arithmetic():
    assert fleet_cost_usd(5_442, 8, 2.0) == 87_072
    # an idle hour costs nothing, a cheap GPU-hour is a price like any other
    assert fleet_cost_usd(0.0, 8, 2.0) == 0.0
    assert fleet_cost_usd(10.0, 8, 0.5) == 40.0
    rev = revenue_usd(342e9, 266e9, 168e9, R1_PRICES)
    assert rev == pytest.approx(562_027, rel=0.002)
    assert margin(562_027, 87_072) == pytest.approx(5.45, abs=0.01)
    with pytest.raises(InputError):
        margin(1.0, 0.0)
    with pytest.raises(InputError):
        Prices(output=-1)


def test_serving_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, moeinfra.serving, moeinfra.serving.figures, moeinfra.cli.serve; "
        "import moeinfra.report.serving_section; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_decode_step_never_falls_as_the_batch_grows():
    """Across DeepGEMM's 64 -> 128-row jump (287 -> 533 TFLOPS) too: 12-16 tokens per micro-batch
    on DeepSeek's decode unit, where the routed experts' interpolated time used to dip."""
    decode = PerfModel(deepseek_decode_unit(), hardware("h800"))
    batch = np.linspace(0.5, 512.0, 4000)
    for kv in (0.0, 4989.0):
        assert (np.diff(decode.decode_step_s(batch, kv)) >= 0).all()


@settings(max_examples=30, deadline=None)
@given(
    batch=st.floats(0.5, 512.0),
    kv=st.floats(0.0, 128_000.0),
    more=st.floats(1.01, 4.0),
)
def test_decode_step_is_positive_and_monotone(batch, kv, more):
    decode = PerfModel(deepseek_decode_unit(), hardware("h800"))
    base = float(decode.decode_step_s(batch, kv))
    assert np.isfinite(base) and base > 0
    assert float(decode.decode_step_s(batch * more, kv)) >= base
    assert float(decode.decode_step_s(batch, kv * more + 1)) >= base


def test_utilisation_schedule_whole_units():
    from moeinfra.serving.schedule import utilisation_schedule

    arrival = np.array([10.0, 20.0, 1000.0])
    sched = utilisation_schedule(
        arrival, np.array([630.0, 0.0, 10.0]), np.array([1260.0, 0.0, 0.0]), 1800.0, target=0.7
    )
    # first 15 minutes: 630 s of prefill work / (900 s * 0.7) = 1 unit, 1260 s decode -> 2 units
    assert sched.at(0.0) == (1, 2)
    assert sched.at(1000.0) == (1, 1)
    assert sched.summary()["node_hours"] == pytest.approx((4 + 36) / 4 + (4 + 18) / 4)


def test_low_latency_law_reproduces_its_sources():
    """DeepEP's published latency at 128 tokens; below it, the 16-token / 128-token ratio of DeepEP
    measured on 8 H100 nodes (AIConfigurator)."""
    hw = hardware("h800")
    balanced = ExpertBalance(
        imbalance=1.0, nodes_per_token=4.0, slots_per_gpu=2, gpus_per_token=8.0
    )
    decode = PerfModel(Deployment("decode", 16, redundant_experts=0), hw, balance=balanced)
    at_128 = decode._a2a_low_latency(128.0)
    at_16 = decode._a2a_low_latency(16.0)
    assert at_128[0] == pytest.approx(192e-6) and at_128[1] == pytest.approx(369e-6)
    assert at_16[0] / at_128[0] == pytest.approx(45.73 / 166.77, rel=1e-9)
    assert at_16[1] / at_128[1] == pytest.approx(59.57 / 304.73, rel=1e-9)
    assert decode.eff.ll_fixed_share == pytest.approx((0.1705, 0.0806), abs=1e-4)


# Decode steps measured by others on DeepSeek-V3 with DP attention and wide EP; none is an input.
# (hardware, nodes, redundant experts, requests per GPU, mean KV, measured step s, source).
# EP128 has no 32-redundant layout (288 slots on 128 GPUs): it gets a third slot per GPU.
MEASURED_DECODE = [
    ("h800", 16, 128, 128, 4_096, 128 / (18_598 / 8), "DeepSeek profile, EP128: 18,598 tok/s"),
    ("h800", 18, 32, 91.7, 5_000, 1 / 20.0, "RTP-LLM, EP144, 13,200 concurrent: 20 tok/s per user"),
    ("h800", 18, 32, 4.0, 5_000, 1 / 42.0, "RTP-LLM, EP144, low concurrency: 42 tok/s per user"),
    ("h100", 9, 32, 256, 2_000, 256 / (22_282 / 8), "SGLang, EP72: 22,282 tok/s per node"),
]


@pytest.mark.parametrize("case", MEASURED_DECODE, ids=lambda c: c[6].split(":")[0])
def test_decode_step_against_independent_measurements(case):
    """The model is optimistic: within 35% below what deployed systems measure, never above."""
    hw, nodes, redundant, batch, kv, measured, _ = case
    unit = Deployment("decode", nodes, redundant_experts=redundant)
    step = float(PerfModel(unit, hardware(hw)).decode_step_s(batch, kv))
    assert 0.65 * measured <= step <= 1.05 * measured


def test_prefill_against_deepseek_profile():
    """DeepSeek's prefill profile (EP32, 16K tokens per GPU, 4K prompts): 62,713 computed tokens/s
    per node as read by LMSYS. The model is 1.28x optimistic here (docs/serving-model.md)."""
    prefill = PerfModel(Deployment("prefill", 4), hardware("h800"))
    step = prefill.prefill_breakdown()
    per_node = step.tokens_per_gpu * prefill.gpus / step.step_s / 4
    assert 1.0 <= per_node / 62_713 <= 1.5


def test_gemms_run_at_deepgemm_published_throughput():
    """DeepGEMM's H800 table for DeepSeek-V3's shapes: exact at its rows, held below the smallest."""
    prefill = PerfModel(Deployment("prefill", 4), hardware("h800"))
    kv_up = prefill._deepgemm("kv_up", 4096, 32768, 512)
    assert kv_up == pytest.approx(2 * 4096 * 32768 * 512 / 590e12)
    out_128 = prefill._deepgemm("attn_out", 128, 7168, 16384)
    assert out_128 == pytest.approx(2 * 128 * 7168 * 16384 / 645e12)
    masked = prefill._deepgemm("expert_up_masked", 256, 4096, 7168, groups=2)
    assert masked == pytest.approx(2 * 2 * 256 * 4096 * 7168 / 932e12)
    # below the grouped kernels' smallest published rows: the plain GEMM of that shape, then held
    few = prefill._deepgemm("expert_down_contiguous", 128, 7168, 2048)
    assert few == pytest.approx(2 * 128 * 7168 * 2048 / 510e12)
    assert prefill._deepgemm("expert_up_masked", 10, 4096, 7168) == pytest.approx(
        2 * 64 * 4096 * 7168 / 287e12
    )
    between = prefill._deepgemm("q_up", 1024, 24576, 1536)
    assert 2 * 1024 * 24576 * 1536 / 990e12 < between < 2 * 1024 * 24576 * 1536 / 535e12


@pytest.mark.parametrize("batch", [0.3, 7.0, 35.0, 88.0, 500.0])
def test_decode_gemm_curves_match_the_exact_gemm_model(batch):
    decode = PerfModel(deepseek_decode_unit(), hardware("h800"))
    nb = batch / decode.dep.micro_batches
    attn_proj, _, shared, routed, *_ = decode._decode_parts(batch, 0.0)
    parts = {"attn_proj": attn_proj, "shared": shared, "routed": routed}
    exact = {
        "attn_proj": mla_projections(decode, nb, nb),
        "shared": decode._experts("", nb, 1),
        "routed": decode._experts("_masked", decode._rows_per_expert(nb), decode._slots),
    }
    for name, value in exact.items():
        assert float(parts[name]) == pytest.approx(float(value), rel=1e-3)
