"""Ranges beside the point figures (#13 item 4): step times scaled by the spread of a
calibration's measured / predicted ratios, and the simulation and plan rerun at both ends."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from moeinfra.errors import InputError
from moeinfra.serving.calibration import StepPoint, load_calibration
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY, TIME_TERMS, Efficiency, PerfModel
from moeinfra.serving.planner import Shape, plan_capacity
from moeinfra.serving.scenario import build_scenario
from moeinfra.serving.specs import Deployment, hardware
from moeinfra.serving.uncertainty import (
    has_spread,
    plan_figures,
    ranges,
    step_time_bounds,
)
from moeinfra.serving.workload import Workload

H800 = hardware("h800")


@pytest.mark.parametrize(
    ("phase", "nodes", "micro_batches"),
    [("prefill", 4, 2), ("prefill", 1, 2), ("prefill", 4, 1), ("decode", 18, 2), ("decode", 1, 2)],
)
def test_scaling_the_time_terms_scales_every_step(phase, nodes, micro_batches):
    """A step is sums and maxima of terms each carrying one of the time terms, so x k on all of
    them is x k on the step: RDMA and NVLink all-to-alls, one and two micro-batches, the overheads
    (set non-zero here so they count)."""
    eff = replace(DEFAULT_EFFICIENCY, prompt_overhead_s=2e-3, comm_launch_s=40e-6)
    dep = Deployment(phase, nodes, redundant_experts=32, micro_batches=micro_batches)
    base, slow = PerfModel(dep, H800, eff=eff), PerfModel(dep, H800, eff=eff.scaled(1.7))
    if phase == "prefill":
        for tokens, prompt in ((512.0, 512.0), (16384.0, 4096.0)):
            b = base.prefill_breakdown(tokens, attn_keys_per_token=900.0, prompt_len=prompt)
            s = slow.prefill_breakdown(tokens, attn_keys_per_token=900.0, prompt_len=prompt)
            assert s.step_s == pytest.approx(1.7 * b.step_s, rel=1e-12)
    else:
        batch, kv = np.array([1.0, 32.0, 128.0]), np.array([300.0, 4096.0, 20000.0])
        np.testing.assert_allclose(
            slow.decode_step_s(batch, kv, 1.1, 1.2),
            1.7 * base.decode_step_s(batch, kv, 1.1, 1.2),
            rtol=1e-12,
        )


def test_scaled_touches_only_the_time_terms_and_refuses_a_bad_factor():
    eff = DEFAULT_EFFICIENCY.scaled(3.0)
    for name in Efficiency.__dataclass_fields__:
        want = getattr(DEFAULT_EFFICIENCY, name)
        assert getattr(eff, name) == (3.0 * want if name in TIME_TERMS else want), name
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(InputError, match="time scale"):
            DEFAULT_EFFICIENCY.scaled(bad)


def _with_ratios(calibration, ratios: dict[str, list[float]]):
    """``calibration`` whose points of each phase measured ``ratio`` x what it predicts."""
    base = next(p for p in calibration.fit_points if p.phase == "decode")
    pre = next(p for p in calibration.fit_points if p.phase == "prefill")
    points = []
    for phase, template in (("prefill", pre), ("decode", base)):
        for i, r in enumerate(ratios[phase]):
            p = replace(template, tokens=template.tokens * (1 + i))
            points.append(replace(p, seconds=float(calibration.predict([p])[0]) * r))
    return replace(
        calibration, fit_points=tuple(points[::2]), validation_points=tuple(points[1::2])
    )


def test_bounds_are_the_extreme_measured_over_predicted_ratios_of_each_phase():
    cal = _with_ratios(
        load_calibration("deepseek-h800"), {"prefill": [1.1, 0.9, 1.25], "decode": [0.8, 1.05]}
    )
    bounds = step_time_bounds(cal)
    assert bounds["fast"] == pytest.approx((0.9, 0.8), rel=1e-12)
    assert bounds["slow"] == pytest.approx((1.25, 1.05), rel=1e-12)
    assert has_spread(bounds)
    # a calibration with as many points as factors fits them exactly: no spread
    exact = step_time_bounds(load_calibration("deepseek-h800"))
    assert not has_spread(exact)
    assert exact["fast"] == pytest.approx((1.0, 1.0), abs=1e-9)
    # a phase without points does not move
    only_decode = replace(
        cal,
        fit_points=tuple(p for p in cal.fit_points if p.phase == "decode"),
        validation_points=(),
    )
    assert only_decode.measured_over_predicted("prefill") == (1.0, 1.0)


def test_ranges_span_the_point_and_both_bounds():
    got = ranges(
        {"a": 2.0, "b": 5.0, "c": 1.0},
        {"a": 1.5, "b": 6.0, "c": None},
        {"a": 3.0, "b": 5.5, "c": 2.0},
    )
    assert got == {"a": [1.5, 3.0], "b": [5.0, 6.0], "c": [None, None]}


def test_a_scenario_scales_each_phase_by_its_own_factor():
    base = build_scenario(hours=0.1, scale=1000.0)
    scaled = build_scenario(hours=0.1, scale=1000.0, time_scale=(2.0, 3.0))
    assert scaled.prefill.prefill_breakdown().step_s == pytest.approx(
        2.0 * base.prefill.prefill_breakdown().step_s, rel=1e-12
    )
    assert float(scaled.decode.decode_step_s(64.0, 4000.0)) == pytest.approx(
        3.0 * float(base.decode.decode_step_s(64.0, 4000.0)), rel=1e-12
    )


def test_slower_steps_never_plan_a_cheaper_fleet():
    rng = np.random.default_rng(3)
    n = 6000  # x 20: 200 requests/s for 10 minutes, several units of each phase
    workload = Workload(
        np.sort(rng.uniform(0, 600, n)),
        rng.integers(500, 4000, n),
        rng.integers(50, 400, n),
        np.zeros(n, dtype=np.int64),
        20.0,
        600.0,
    )
    args = dict(
        slo_ttft_p95_s=2.0,
        slo_tpot_p95_s=0.06,
        shapes=[Shape("prefill", 4, 32), Shape("decode", 4, 32)],
    )
    plans = [plan_capacity(workload, **args, time_scale=(k, k)) for k in (0.8, 1.0, 1.6)]
    nodes = [plan_figures(p)["nodes"] for p in plans]
    assert nodes == sorted(nodes) and nodes[0] < nodes[-1], nodes


def cli(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_simulate_reports_ranges_from_the_calibration_in_force(tmp_path):
    point = cli("simulate", "--hours", "0.5", "--scale", "200", "--calibration", "sglang-h100")
    cal = load_calibration("sglang-h100")
    bounds = point["step_time_bounds"]
    assert bounds["fast"][0] == pytest.approx(cal.measured_over_predicted("prefill")[0])
    assert bounds["slow"][0] == pytest.approx(cal.measured_over_predicted("prefill")[1])
    assert bounds["fast"][0] < 1.0 < bounds["slow"][0]  # SGLang's prefill points straddle the fit
    r = point["ranges"]
    assert r["ttft_p95_s"][0] < point["ttft_s"]["p95"] < r["ttft_p95_s"][1]
    assert r["tpot_p95_s"][0] <= point["tpot_s"]["p95"] <= r["tpot_p95_s"][1]
    assert r["cost_usd"] == [point["cost_usd"]] * 2  # the published node curve is an input
    # the fast bound's prefill is the point's prefill x its ratio: a run with that scale alone
    # gives the range's low TTFT end
    fast = build_scenario(
        hours=0.5, scale=200.0, calibration=cal, time_scale=tuple(bounds["fast"])
    ).run()
    assert float(np.percentile(fast.ttft_s[np.isfinite(fast.ttft_s)], 95)) == pytest.approx(
        r["ttft_p95_s"][0], rel=1e-9
    )
    exact = cli("simulate", "--hours", "0.25", "--scale", "400", "--calibration", "deepseek-h800")
    assert exact["ranges"]["ttft_p95_s"] == [exact["ttft_s"]["p95"]] * 2
    assert "no spread" in exact["range_method"]
    plain = cli("simulate", "--hours", "0.25", "--scale", "400", "--calibration", "none")
    assert plain["ranges"] is None and "no residuals" in plain["range_method"]
    assert plain["calibration"] == "none"


def test_h800_defaults_to_the_rtp_llm_calibration_and_other_hardware_to_none():
    """The default calibration on H800 is rtp-llm-h800 (fitted on RTP-LLM's EP144 decode curve,
    never on DeepSeek's day); first principles are --calibration none; hardware with no shipped
    calibration, and measured kernels, default to none."""
    default = cli("simulate", "--hours", "0.05", "--scale", "1000")
    named = cli("simulate", "--hours", "0.05", "--scale", "1000", "--calibration", "rtp-llm-h800")
    assert default["calibration"]["name"] == "rtp-llm-h800"
    assert default == named
    assert default["ranges"] is not None
    for command in (["model"], ["frontier", "--nodes", "18"], ["position-cost"]):
        assert cli(*command)["calibration"]["name"] == "rtp-llm-h800"
        assert cli(*command, "--hardware", "h100")["calibration"] == "none"
    plan = cli("plan", "--demand", "20000", "--hours", "0.05", "--modes", "disaggregated",
               "--prefill-nodes", "4", "--decode-nodes", "18", "--micro-batches", "2")  # fmt: skip
    assert plan["calibration"]["name"] == "rtp-llm-h800"


def test_plan_reports_ranges(tmp_path):
    trace = tmp_path / "trace.csv"
    rows = ["timestamp,input_tokens,output_tokens"] + [
        f"{i * 0.1:.2f},{1500 + (i * 37) % 3000},{100 + (i * 13) % 400}" for i in range(2000)
    ]
    trace.write_text("\n".join(rows) + "\n")
    plan = cli(
        "plan", "--workload", str(trace), "--slo-ttft-p95", "6s", "--slo-tpot", "90ms",
        "--calibration", "sglang-h100", "--modes", "disaggregated", "--prefill-nodes", "4",
        "--decode-nodes", "4,8", "--micro-batches", "2",
    )  # fmt: skip
    r = plan["ranges"]
    assert r["nodes"][0] <= plan["nodes"] <= r["nodes"][1]
    assert r["ttft_p95_s"][0] < plan["ttft_p95_s"] < r["ttft_p95_s"][1]
    assert set(plan["step_time_bounds"]) == {"fast", "slow"}


def test_step_point_ratio_uses_measured_seconds():
    """measured / predicted, not the reverse: a point measured twice as slow as predicted makes
    the slow bound 2."""
    cal = load_calibration("deepseek-h800")
    p = next(p for p in cal.fit_points if p.phase == "decode")
    slow = StepPoint(**{**p.__dict__, "seconds": 2.0 * float(cal.predict([p])[0])})
    doubled = replace(cal, fit_points=(slow,), validation_points=())
    assert doubled.measured_over_predicted("decode") == pytest.approx((2.0, 2.0))
