"""Measured kernel tables in place of first-principles times (serve model --kernels aiconfigurator)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeinfra.errors import InputError
from moeinfra.serving import kernels as kernels_module
from moeinfra.serving.calibration import load_calibration
from moeinfra.serving.kernels import Curve, KernelTables
from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.specs import HARDWARE, Deployment, fitting_redundant_experts

ROWS = json.loads((Path(__file__).parent / "data" / "aiconfigurator_h100_rows.json").read_text())
TABLES = KernelTables(ROWS["system"], ROWS["rows"])
SHAPE = {"hidden": 7168, "topk": 8, "experts": 256, "inter": 2048}


def _row(table: str, **match) -> dict:
    (row,) = [r for r in ROWS["rows"][table] if all(r[k] == v for k, v in match.items())]
    return row


def test_a_curve_is_measured_at_its_points_interpolated_between_and_never_extrapolated():
    curve = Curve(np.array([100.0, 200.0]), np.array([1.0, 3.0]), "k")
    assert (curve.at(100.0, 9.0).seconds, curve.at(100.0, 9.0).source) == (1.0, "measured")
    mid = curve.at(150.0, 9.0)
    assert (mid.seconds, mid.source) == (2.0, "interpolated")
    for outside in (50.0, 400.0):
        t = curve.at(outside, 9.0)
        assert (t.seconds, t.source) == (9.0, "first-principles")
        assert "outside the measured 100-200" in t.note


def test_all_to_all_curves_take_deepseeks_24_sms_and_sum_transmit_and_notify():
    dispatch, combine = TABLES.all_to_all("normal", 4, SHAPE)
    row = _row("deepep_normal", node_num=4, num_token=16384, dispatch_sms=24)
    i = list(dispatch.tokens).index(16384.0)
    assert dispatch.seconds[i] == pytest.approx(
        (row["dispatch_transmit_us"] + row["dispatch_notify_us"]) * 1e-6
    )
    assert combine.seconds[i] == pytest.approx(
        (row["combine_transmit_us"] + row["combine_notify_us"]) * 1e-6
    )
    assert "24 SMs" in dispatch.what
    # one node was measured at 20 SMs only: the most it has
    assert "20 SMs" in TABLES.all_to_all("normal", 1, SHAPE)[0].what
    assert TABLES.all_to_all("normal", 18, SHAPE) is None
    assert TABLES.all_to_all("normal", 4, SHAPE | {"experts": 128}) is None


def test_routed_expert_curve_is_per_gpu_tokens_and_uniform_routing():
    curve = TABLES.routed_experts("prefill", 32, SHAPE)
    row = _row("moe_prefill", moe_ep_size=32, num_tokens=262144, distribution="uniform")
    assert list(curve.tokens) == [4096.0, 8192.0, 16384.0]
    assert curve.seconds[1] == pytest.approx(row["latency"] * 1e-3)
    assert TABLES.routed_experts("decode", 144, SHAPE) is None


def _prefill(kernels=None) -> PerfModel:
    return PerfModel(Deployment("prefill", 4), HARDWARE["h100"], kernels=kernels)


def test_prefill_takes_the_measured_moe_and_all_to_all_and_keeps_the_rest():
    plain, measured = _prefill().prefill_breakdown(), _prefill(TABLES).prefill_breakdown()
    assert plain.sources == {}
    # the heaviest GPU's 8,192 tokens per micro-batch x the EPLB imbalance: between two points
    assert measured.sources["routed"].startswith("interpolated (grouped MoE GEMMs, EP32")
    assert measured.sources["dispatch"].startswith("interpolated (DeepEP normal, 4 node(s)")
    assert "NVIDIA H100 (h100_sxm table)" in measured.sources["dispatch"]
    pm = _prefill()
    heaviest = 8192 * pm.balance.imbalance
    moe = TABLES.routed_experts("prefill", 32, SHAPE)
    all_sms = np.interp(heaviest, moe.tokens, moe.seconds)
    assert measured.parts["routed"][10] == pytest.approx(2 * all_sms / (108 / 132))
    for part in ("attn_proj", "core_attn", "shared", "gate", "dense_mlp"):
        np.testing.assert_array_equal(measured.parts[part], plain.parts[part])
    dispatch_curve = TABLES.all_to_all("normal", 4, SHAPE)[0]
    assert measured.parts["dispatch"][10] == pytest.approx(
        2 * np.interp(heaviest, dispatch_curve.tokens, dispatch_curve.seconds)
    )
    assert measured.step_s > plain.step_s  # SGLang's MoE block is slower than DeepGEMM alone


def test_a_unit_without_tables_stays_first_principles_and_says_why():
    dep = Deployment("decode", 18)
    plain = PerfModel(dep, HARDWARE["h100"]).decode_breakdown(64, 4989)
    b = PerfModel(dep, HARDWARE["h100"], kernels=TABLES).decode_breakdown(64, 4989)
    assert b.step_s == plain.step_s
    assert b.sources == {
        "routed": "first-principles (no measured EP144 MoE)",
        "dispatch": "first-principles (no measured 18-node DeepEP low-latency)",
        "combine": "first-principles (no measured 18-node DeepEP low-latency)",
    }


def test_decode_outside_the_measured_tokens_is_first_principles_not_extrapolated():
    dep = Deployment("decode", 8, redundant_experts=fitting_redundant_experts(8))
    first = PerfModel(dep, HARDWARE["h100"]).decode_breakdown(1024, 2000)
    b = PerfModel(dep, HARDWARE["h100"], kernels=TABLES).decode_breakdown(1024, 2000)
    # 512 tokens per micro-batch: beyond the 256 the low-latency table reaches
    assert "outside the measured 16-256" in b.sources["dispatch"]
    assert b.parts["dispatch"][10] == first.parts["dispatch"][10]


def test_tables_refuse_hardware_they_do_not_have_and_a_missing_package(monkeypatch, tmp_path):
    with pytest.raises(InputError, match=r"--hardware='h800' has no AIConfigurator"):
        KernelTables.aiconfigurator("h800")
    monkeypatch.setattr(kernels_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InputError, match=r"pip install 'moeinfra\[aic\]'"):
        KernelTables.aiconfigurator("h100")
    with pytest.raises(InputError, match=r"wideep_deepep_normal_perf.parquet is missing"):
        KernelTables.aiconfigurator("h100", data_dir=tmp_path)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kernels", "aic"], "error: --kernels='aic' must be one of first-principles, "),
        (["--kernels", "aiconfigurator"], "error: --kernels aiconfigurator: --hardware='h800'"),
        (
            ["--kernels", "aiconfigurator", "--calibration", "sglang-h100"],
            "error: --kernels=aiconfigurator replaces the first-principles times",
        ),
    ],
)
def test_cli_names_the_kernels_problem(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "moeinfra", "serve", "model", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1


def test_installed_tables_hold_the_rows_copied_here():
    """Where aiconfigurator-core is installed (pip install 'moeinfra[aic]'), its tables give the
    same curves as the rows copied into the test data (MoE latencies copied to 10 digits)."""
    pytest.importorskip("aiconfigurator_core")
    installed = KernelTables.aiconfigurator("h100")
    pairs = [
        (TABLES.all_to_all(kind, n, SHAPE), installed.all_to_all(kind, n, SHAPE))
        for kind, nodes in (("normal", (1, 2, 4, 8)), ("low_latency", (2, 4, 8)))
        for n in nodes
    ] + [
        ((TABLES.routed_experts(phase, ep, SHAPE),), (installed.routed_experts(phase, ep, SHAPE),))
        for phase in ("prefill", "decode")
        for ep in (32, 64)
    ]
    for mine, theirs in pairs:
        for a, b in zip(mine, theirs, strict=True):
            keep = np.isin(b.tokens, a.tokens)
            assert keep.sum() == a.tokens.size
            np.testing.assert_allclose(b.seconds[keep], a.seconds, rtol=1e-9)


def test_the_simulators_decode_step_takes_the_measured_tables_as_serve_model_does():
    for nodes in (4, 8):
        dep = Deployment("decode", nodes, fitting_redundant_experts(nodes))
        measured = PerfModel(dep, HARDWARE["h100"], kernels=TABLES)
        plain = PerfModel(dep, HARDWARE["h100"])
        # 0.25 to 400 tokens per micro-batch: below, inside and above the copied tables' 16-256
        batch = np.array([0.5, 40.0, 64.0, 128.0, 800.0])
        steps = measured.decode_step_s(batch, np.full(batch.size, 3000.0))
        for b, step in zip(batch, steps, strict=True):
            assert step == pytest.approx(measured.decode_breakdown(float(b), 3000.0).step_s)
        first = plain.decode_step_s(batch, np.full(batch.size, 3000.0))
        # outside the measured tokens the step is the first-principles one; inside it moves
        # where the measured part is not hidden behind the other micro-batch
        assert steps[0] == pytest.approx(first[0]) and steps[-1] == pytest.approx(first[-1])
        assert np.any(np.abs(steps[1:4] / first[1:4] - 1) > 0.02)
    coverage = measured.kernel_coverage()
    # the rows copied here (the installed tables measure more points)
    assert coverage["dispatch"].startswith("16-256 tokens per GPU: DeepEP low-latency, 8 node(s)")
    assert coverage["routed"].startswith("32-128 tokens per GPU: grouped MoE GEMMs, EP64")
    eighteen = PerfModel(Deployment("decode", 18), HARDWARE["h100"], kernels=TABLES)
    assert set(eighteen.kernel_coverage().values()) == {
        "first-principles (no measured table for this 18-node unit)"
    }
    assert plain.kernel_coverage() is None


def test_simulate_and_plan_run_on_measured_kernels(monkeypatch):
    from moeinfra.serving.planner import Shape, plan_capacity
    from moeinfra.serving.scenario import build_scenario
    from moeinfra.serving.unit_cost import prefill_cost
    from moeinfra.serving.workload import constant_demand

    # ~70 requests per decode GPU: 35 per micro-batch, inside the copied low-latency rows (16-256)
    work = constant_demand(150_000.0, hours=0.05, scale=1.0)
    args = dict(workload=work, hardware_name="h100", fleet=(6, 1))
    units = dict(
        prefill_dep=Deployment("prefill", 4),
        decode_dep=Deployment("decode", 8, fitting_redundant_experts(8)),
    )
    scenarios = [build_scenario(**args, **units, kernels=TABLES), build_scenario(**args, **units)]
    measured, plain = (s.run() for s in scenarios)
    # the measured all-to-all and MoE GEMMs differ from the model's: so do the decode latencies
    # and the prefill work at full steps (these prompts are computed in steps far below them)
    assert np.nanmedian(measured.tpot_s) != pytest.approx(np.nanmedian(plain.tpot_s), rel=0.01)
    works = [prefill_cost(s.prefill, s.decode, work).work_s.mean() for s in scenarios]
    assert works[0] != pytest.approx(works[1], rel=0.01)
    shapes = [Shape("prefill", 4, 32), Shape("decode", 8, 64)]
    plan = plan_capacity(
        work, slo_ttft_p95_s=3.0, slo_tpot_p95_s=0.08, hw="h100", shapes=shapes, kernels=TABLES
    )
    assert plan.decode.meets_slo and plan.prefill.meets_slo
    with pytest.raises(InputError, match="one or the other"):
        plan_capacity(
            work,
            slo_ttft_p95_s=3.0,
            slo_tpot_p95_s=0.08,
            shapes=shapes,
            kernels=TABLES,
            calibration=load_calibration("sglang-h100"),
        )


def test_decode_inside_the_measured_range_takes_the_low_latency_curve_per_micro_batch():
    dep = Deployment("decode", 8, redundant_experts=fitting_redundant_experts(8))
    perf = PerfModel(dep, HARDWARE["h100"], kernels=TABLES)
    b = perf.decode_breakdown(128, 2000)
    # two micro-batches of 64 requests; the heaviest GPU receives 64 x the EPLB imbalance rows
    dispatch_curve, _ = TABLES.all_to_all("low_latency", 8, SHAPE)
    tokens = 64 * perf.balance.imbalance
    assert b.sources["dispatch"].startswith("interpolated (DeepEP low-latency, 8 node(s)")
    assert b.parts["dispatch"][10] == pytest.approx(
        2 * np.interp(tokens, dispatch_curve.tokens, dispatch_curve.seconds)
    )
