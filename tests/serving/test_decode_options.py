"""Decode-unit options in the simulator: multi-token prediction and a batch limit per GPU."""

import numpy as np
import pytest

from moeinfra.errors import InputError
from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.schedule import constant_schedule
from moeinfra.serving.simulate import COMPLETED, SimConfig, simulate
from moeinfra.serving.specs import Deployment, deepseek_prefill_unit, hardware
from moeinfra.serving.unit_cost import prefill_cost
from moeinfra.serving.workload import Workload

HW = hardware("h800")
PREFILL = PerfModel(deepseek_prefill_unit(), HW)


def few_requests(n=8, output=400, gap_s=0.5):
    arrival = np.arange(n) * gap_s
    return Workload(arrival, np.full(n, 1000), np.full(n, output), np.zeros(n), 1.0, 60.0)


def run(decode, workload, tick_s=0.05):
    cfg = SimConfig(tick_s=tick_s, record_every_s=1.0, drain_s=600.0)
    schedule = constant_schedule(1, 1, workload.duration_s, 4, decode.dep.nodes)
    return simulate(workload, schedule, PREFILL, decode, cfg)


def test_mtp_divides_the_time_per_token_by_the_tokens_a_step_yields():
    plain = PerfModel(Deployment("decode", 18), HW)
    mtp = PerfModel(Deployment("decode", 18, mtp_acceptance=0.85), HW)
    w = few_requests()
    a, b = run(plain, w), run(mtp, w)
    assert np.all(a.status == COMPLETED) and np.all(b.status == COMPLETED)
    # 8 requests on 144 GPUs: one request per busy rank, the step at batch 1 (paced by the fullest
    # rank), with two query tokens and the MTP layer when MTP is on
    kv = 1000 + 200  # mean KV length over a 400-token answer
    expected = (mtp.decode_step_s(1.0, kv) / 1.85) / plain.decode_step_s(1.0, kv)
    ratio = np.median(b.tpot_s) / np.median(a.tpot_s)
    assert ratio == pytest.approx(float(expected), rel=0.05)
    assert 0.5 < ratio < 0.6  # the V3 report's "1.8x TPS" at a small batch
    # every token is counted once, drafts included
    assert b.totals["output_tokens"] == pytest.approx(a.totals["output_tokens"], rel=1e-6)
    # an accepted draft streams with the step's token: 0.85 / 1.85 = 46% of gaps are ~0
    assert b.itl_percentiles((40,))["p40"] < 1e-3 < a.itl_percentiles((40,))["p40"]
    assert b.itl_percentiles((50,))["p50"] > 1e-2


def test_the_mtp_module_is_one_more_layer_of_weights_and_compute():
    plain = PerfModel(Deployment("decode", 18), HW)
    mtp = PerfModel(Deployment("decode", 18, mtp_acceptance=0.9), HW)
    assert mtp.model.num_layers == plain.model.num_layers + 1
    assert mtp.memory_use().weights > plain.memory_use().weights
    assert mtp.balance is plain.balance  # the same EPLB plan (computed once per slot layout)
    # two query tokens per request: the same as asking the plain unit for them
    assert mtp.decode_step_s(32.0, 4000.0) > plain.decode_step_s(32.0, 4000.0, queries=2)


def test_a_batch_limit_holds_requests_back_and_none_are_lost():
    free = PerfModel(Deployment("decode", 4), HW)
    capped = PerfModel(Deployment("decode", 4, max_batch_per_gpu=0.25), HW)  # 8 per 32 GPUs
    w = few_requests(n=24, gap_s=0.01)
    a, b = run(free, w), run(capped, w)
    assert np.all(b.status == COMPLETED)
    assert np.nanmax(b.decode_batch_per_gpu) <= 0.25 + 1e-9
    assert np.nanmax(a.decode_batch_per_gpu) > 0.25
    # those held back wait for a slot: it shows in their time per output token
    assert np.percentile(b.tpot_s, 95) > 1.5 * np.percentile(a.tpot_s, 95)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"phase": "decode", "nodes": 4, "mtp_acceptance": 1.0}, "mtp_acceptance=1.0"),
        ({"phase": "decode", "nodes": 4, "max_batch_per_gpu": 0.0}, "max_batch_per_gpu=0.0"),
        ({"phase": "prefill", "nodes": 4, "mtp_acceptance": 0.5}, "decode units only"),
    ],
)
def test_bad_decode_options_are_refused(kwargs, named):
    with pytest.raises(InputError, match=named):
        Deployment(**kwargs)


def colocated_run(workload, units=1, nodes=4, tick_s=0.01):
    prefill = PerfModel(Deployment("prefill", nodes), HW)
    decode = PerfModel(Deployment("decode", nodes), HW)
    cfg = SimConfig(tick_s=tick_s, record_every_s=max(1.0, tick_s), drain_s=600.0)
    schedule = constant_schedule(units, units, workload.duration_s, nodes, nodes, colocated=True)
    return simulate(workload, schedule, prefill, decode, cfg), prefill, decode


def test_a_colocated_unit_stops_decoding_while_it_prefills():
    # request 0 decodes 2,000 tokens alone; request 1 (one output token: prefill only) arrives
    # with a 30K-token prompt; on a colocated unit request 0 finishes later by exactly the
    # unit-seconds of that prefill

    work = None
    for tick_s, at in ((0.01, 1.0), (2.0, 1.9)):  # fine ticks; a prefill that spills past a tick

        def workload(prompts, at=at):
            n = len(prompts)
            arrival = np.array([0.0, at][:n])
            outputs = np.array([2000, 1][:n])
            return Workload(arrival, np.array(prompts), outputs, np.zeros(n), 1.0, 10.0)

        alone, prefill, decode = colocated_run(workload([1000]), tick_s=tick_s)
        both, _, _ = colocated_run(workload([1000, 30_000]), tick_s=tick_s)
        both_w = workload([1000, 30_000])
        spans = prefill_cost(prefill, decode, both_w, "deepseek").queue(both_w, 1)
        spans = spans.admit(0, 2, 1, last=True)[4]
        work = float((spans[1:, 2] - spans[1:, 1]).sum())  # request 1's steps
        assert work > 0.1
        assert both.finish_s[0] - alone.finish_s[0] == pytest.approx(work, rel=0.02)


def test_a_request_does_not_wait_for_its_own_prefill_twice():
    # one request alone: on a colocated unit it decodes once its prefill is done, as on a
    # disaggregated pair, without paying the KV transfer
    w = Workload(np.array([0.5]), np.array([30_000]), np.array([50]), np.zeros(1), 1.0, 10.0)
    together, _, _ = colocated_run(w, tick_s=2.0)
    apart = simulate(
        w,
        constant_schedule(1, 1, 10.0, 4, 4),
        PerfModel(Deployment("prefill", 4), HW),
        PerfModel(Deployment("decode", 4), HW),
        SimConfig(tick_s=2.0, record_every_s=2.0, drain_s=600.0),
    )
    assert together.tpot_s[0] <= apart.tpot_s[0] * 1.001


def test_colocated_units_hold_both_phases_and_count_their_nodes_once():
    rng = np.random.default_rng(0)
    n = 1_000
    arrival = np.sort(rng.uniform(0.0, 60.0, n))
    prompts = rng.integers(2_000, 20_000, n)
    w = Workload(arrival, prompts, rng.integers(50, 300, n), np.zeros(n), 1.0, 60.0)
    together, _, _ = colocated_run(w, units=2, tick_s=0.05)
    apart = simulate(
        w,
        constant_schedule(1, 1, 60.0, 4, 4),
        PerfModel(Deployment("prefill", 4), HW),
        PerfModel(Deployment("decode", 4), HW),
        SimConfig(tick_s=0.05, record_every_s=1.0, drain_s=600.0),
    )
    assert np.all(together.status == COMPLETED) and np.all(apart.status == COMPLETED)
    # the same 8 nodes either way
    assert together.totals["avg_nodes"] == apart.totals["avg_nodes"] == 8.0
    assert together.totals["avg_prefill_nodes"] == 0.0
    # decoding beside prefills: the time per output token suffers; prefill has both units
    assert np.percentile(together.tpot_s, 95) > 1.5 * np.percentile(apart.tpot_s, 95)
    assert np.percentile(together.ttft_s, 50) < np.percentile(apart.ttft_s, 50)


def test_a_colocated_schedule_needs_the_same_units_for_both_phases():
    with pytest.raises(InputError, match="colocated"):
        constant_schedule(1, 2, 60.0, 4, 4, colocated=True)
    with pytest.raises(InputError, match="colocated"):
        constant_schedule(1, 1, 60.0, 4, 18, colocated=True)
