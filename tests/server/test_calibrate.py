"""``serve calibrate`` against a live server, and the calibrated simulator against a live replay."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from moeinfra.cli.main import app
from moeinfra.server import bench
from moeinfra.server.calibrate import calibrate_live, compare, predict_replay
from moeinfra.serving.calibration import efficiency_with, load_calibration, predict_seconds

# the calibration and the replay it predicts must see the same machine: with another test worker
# beside them, its load changed between the two (CI, 2026-11-26: TTFT predicted 1.6x the replay's)
pytestmark = pytest.mark.alone


@pytest.fixture(scope="module")
def calibration(server, tmp_path_factory):
    cal = calibrate_live(server.url, name="test-live")
    path = tmp_path_factory.mktemp("cal") / "live.json"
    cal.save(path)
    return cal, path


def test_steps_endpoint_reports_every_units_steps(server, calibration):
    info = httpx.get(f"{server.url}/calibration/steps").json()
    assert info["config"]["model_type"] == "deepseek_v3"
    assert info["capacity"] == 8 + 4  # --max-num-seqs 8 on one decode rank, --max-queue 4
    roles = {u["role"]: u for u in info["units"]}
    assert set(roles) == {"prefill", "decode"}
    assert {s["phase"] for s in roles["prefill"]["steps"]} == {"prefill"}
    assert {s["phase"] for s in roles["decode"]["steps"]} == {"decode"}
    for s in roles["decode"]["steps"]:
        assert s["seconds"] > 0 and s["tokens"] >= 1 and s["attended_keys"] >= s["tokens"]
    ends = [s["ended"] for s in roles["decode"]["steps"]]
    assert ends == sorted(ends) and abs(ends[-1] - time.time()) < 600
    assert roles["decode"]["engine"]["block_size"] == 16


def test_live_calibration_fits_and_validates(calibration):
    calibration, path = calibration
    errors = calibration.errors()
    # steps of 5-30 ms on this shared 2-core machine: fit medians of 5-25% measured
    assert errors["fit"]["median_abs"] < 0.4
    assert errors["validation"]["points"] >= 5 and errors["validation"]["median_abs"] < 0.5
    # the same model uncalibrated (the published-kernel factors) misses the held-out steps more
    held = calibration.validation_points
    measured = np.array([p.seconds for p in held])
    raw = predict_seconds(held, calibration.hardware, calibration.model, efficiency_with({}))
    fitted = calibration.predict(held)
    assert np.median(np.abs(fitted / measured - 1)) < np.median(np.abs(raw / measured - 1))
    assert calibration.hardware.name.startswith("cpu:")
    assert calibration.hardware.gpus_per_node == 1
    assert calibration.model.hidden == 64 and calibration.model.num_layers == 3
    assert calibration.kv_tokens_per_gpu == 256 * 16
    assert 0 <= calibration.factors["request_overhead_s"] < 0.5
    # and under its steady traffic, at the output tokens a second that traffic offered
    assert 0 <= calibration.factors["request_overhead_loaded_s"] < 0.5
    assert calibration.factors["overhead_load_tokens_per_s"] > 0
    # like prefill steps vary on a shared host: their spread is measured, around a median of 1
    jitter = calibration.prefill_step_jitter
    assert len(jitter) == 101 and jitter[0] < 1.0 < jitter[-1] and 0.8 < jitter[50] < 1.25
    # the probe's overlapping waves and steady traffic put steps of both units side by side
    assert any(p.contended > 0.5 for p in calibration.fit_points if p.phase == "decode")
    assert "decode_contention" in calibration.fitted
    assert any(p.interrupts >= 1 for p in calibration.fit_points)
    assert "decode_interrupt_s" in calibration.fitted
    back = load_calibration(str(path))
    assert back.factors == calibration.factors


def test_calibrated_simulator_predicts_a_live_replay(server, calibration, tmp_path):
    """The looser form of the benchmark (docs/benchmarks.md "Calibrated simulator vs live")."""
    calibration, _ = calibration
    trace = bench.synthetic_trace(tmp_path / "t.jsonl", 24, 3.0, seed=3)

    def within(rows):
        return (
            abs(rows["TTFT p50 (s)"]) < 0.5
            and abs(rows["TPOT p50 (s)"]) < 0.4
            and abs(rows["output tokens/s"]) < 0.25
        )

    # the server's own processes share the 2 cores with this test, and a calibration is itself a
    # measurement on them (about one in ten here drew steps slow enough to put the prediction
    # ~60% high): a second replay, then a second calibration and replay, before the bands are
    # judged
    attempts = [(calibration, 0), (calibration, 1), (None, 2)]
    for cal, seed in attempts:
        cal = cal or calibrate_live(server.url, name="test-live-again", seed=1)
        predicted = predict_replay(trace, cal)
        assert predicted["completed"] == 24
        # fresh prompts for each replay: the earlier ones' are in the server's prefix caches
        requests = bench.trace_requests(trace, vocab=1000, block_tokens=64, seed=seed)
        results, wall = asyncio.run(bench.replay(server.url, requests))
        live = bench.summarize(results, wall)
        assert live["errors"] == 0
        rows = {r["figure"]: r["error"] for r in compare(live, predicted)}
        if within(rows):
            break
    assert within(rows), rows


def test_calibration_drives_serve_model_and_simulate(calibration, tmp_path):
    calibration, path = calibration
    runner = CliRunner()
    model = runner.invoke(app, ["serve", "model", "--calibration", str(path), "--json"])
    assert model.exit_code == 0, model.output
    payload = json.loads(model.output)
    assert payload["calibration"]["name"] == "test-live"
    assert payload["hardware"] == calibration.hardware.name and payload["gpus"] == 1
    trace = bench.synthetic_trace(tmp_path / "t.jsonl", 12, 2.0, seed=4)
    sim = runner.invoke(
        app,
        [
            "serve", "simulate", "--workload", str(trace), "--calibration",
            str(path), "--fleet", "1:1", "--tick", "10ms",
            "--hash-block-tokens", "64", "--json",
        ],
    )  # fmt: skip
    assert sim.exit_code == 0, sim.output
    payload = json.loads(sim.output)
    assert payload["calibration"]["name"] == "test-live"
    assert payload["requests"]["completed"] == 12  # drained: none left running


def test_contended_share_is_the_overlap_with_the_union_of_other_steps():
    from moeinfra.server.calibrate import contended_share

    def step(start, end):
        return {"ended": end, "seconds": end - start}

    mine = [step(1, 2), step(4, 5), step(8, 10), step(11, 12)]
    others = [step(0.5, 1.5), step(1.6, 1.8), step(4.25, 4.5), step(4.3, 4.8), step(9, 9.5)]
    # [1,2]: 0.5 + 0.2; [4,5]: the union [4.25, 4.8]; [8,10]: 0.5 of 2; [11,12]: none
    np.testing.assert_allclose(contended_share(mine, others), [0.7, 0.55, 0.25, 0.0])
    assert contended_share(mine, []).tolist() == [0.0] * 4


def test_boundaries_within_counts_other_steps_starting_or_ending_inside():
    from moeinfra.server.calibrate import boundaries_within

    def step(start, end):
        return {"ended": end, "seconds": end - start}

    mine = [step(1, 2), step(4, 5), step(8, 10), step(11, 12)]
    others = [step(0.5, 1.5), step(1.6, 1.8), step(4.25, 4.5), step(3, 6), step(12.5, 13)]
    # [1,2]: an end, a start and an end; [4,5]: a start and an end (the long step is around it)
    assert boundaries_within(mine, others).tolist() == [3, 2, 0, 0]
    assert boundaries_within(mine, []).tolist() == [0] * 4


def test_steady_load_is_poisson_at_the_rate_with_fresh_prompts():
    from moeinfra.server.calibrate import steady_load

    load = steady_load(1000, 512, rate=5.0, seed=0, requests=400)
    gaps = np.diff([r.arrival_s for r in load])
    assert load[0].arrival_s == 0 and (gaps >= 0).all()
    assert np.mean(gaps) == pytest.approx(0.2, rel=0.15)
    assert all(64 <= len(r.prompt_ids) < 256 and 16 <= r.max_tokens <= 64 for r in load)
    assert len({tuple(r.prompt_ids[:8]) for r in load}) == len(load)


def test_request_overhead_under_load_is_what_the_simulated_first_tokens_lack():
    from dataclasses import replace

    from moeinfra.server.calibrate import (
        request_overhead_under_load,
        requests_workload,
        simulated_ttft,
        steady_load,
    )

    cal = load_calibration("deepseek-h800")
    load = steady_load(1000, 512, rate=20.0, seed=0, requests=64)
    workload = requests_workload(load, [0] * len(load))
    bare = simulated_ttft(cal, workload, 1, 1)
    live = [
        bench.BenchResult(r.arrival_s, len(r.prompt_ids), ttft_s=float(np.median(bare)) + d)
        for r, d in zip(load, np.linspace(0.010, 0.030, len(load)), strict=True)
    ]
    measured = request_overhead_under_load(cal, load, live, 1, 1)
    assert measured["request_overhead_loaded_s"] == pytest.approx(0.020, abs=1e-3)
    span = load[-1].arrival_s - load[0].arrival_s + 1.0
    tokens_per_s = sum(r.max_tokens for r in load) / span
    assert measured["overhead_load_tokens_per_s"] == pytest.approx(tokens_per_s)
    # with it in force (and 5 ms on prompts sent alone), the simulator's median first token at
    # the same load is the live median
    with_it = replace(cal, factors=cal.factors | {"request_overhead_s": 0.005} | measured)
    simulated = simulated_ttft(with_it, workload, 1, 1)
    assert float(np.median(simulated)) == pytest.approx(
        np.median([r.ttft_s for r in live]), abs=2e-3
    )
    # a server faster than its own steps adds nothing (never a negative overhead)
    fast = [replace(r, ttft_s=0.5 * float(np.median(bare))) for r in live]
    assert request_overhead_under_load(cal, load, fast, 1, 1)["request_overhead_loaded_s"] == 0.0


def test_request_overhead_grows_with_the_load_up_to_the_one_measured_under_traffic(tmp_path):
    from dataclasses import replace

    cal = load_calibration("deepseek-h800")
    assert cal.at_load(1e6) is cal  # no loaded figure: its one overhead
    measured = {
        "request_overhead_s": 0.004,
        "request_overhead_loaded_s": 0.012,
        "overhead_load_tokens_per_s": 800.0,
    }
    loaded = replace(cal, factors=cal.factors | measured)

    def at(tokens_per_s):
        return loaded.at_load(tokens_per_s).factors["request_overhead_s"]

    assert at(0.0) == pytest.approx(0.004)
    assert at(200.0) == pytest.approx(0.006)
    assert at(800.0) == pytest.approx(0.012)
    assert at(8000.0) == pytest.approx(0.012)  # never extrapolated past what was measured
    assert loaded.efficiency().request_overhead_s == pytest.approx(0.004)
    loaded.save(tmp_path / "c.json")
    assert load_calibration(str(tmp_path / "c.json")).factors == loaded.factors
