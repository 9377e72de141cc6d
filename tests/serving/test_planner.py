"""The capacity planner's search: shapes, pruning by lower bounds, aggregated vs disaggregated."""

import json
import subprocess
import sys

import numpy as np
import pytest

from moeinfra.errors import InputError
from moeinfra.serving.planner import Shape, candidate_shapes, plan_capacity
from moeinfra.serving.workload import Workload


def steady(rate_per_s, seconds=600.0, prompt=(1000, 6000), answer=(50, 400), seed=0):
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate_per_s * seconds)
    return Workload(
        np.sort(rng.uniform(0.0, seconds, n)),
        rng.integers(*prompt, n),
        rng.integers(*answer, n),
        np.zeros(n, dtype=np.int64),
        1.0,
        seconds,
    )


def test_candidate_shapes_spread_slots_evenly_and_vary_only_what_applies():
    shapes = candidate_shapes(
        nodes={"prefill": (4,), "decode": (4, 18), "colocated": (8,)},
        micro_batches=(2,),
        mtp_acceptance=0.85,
        max_batch_per_gpu=(64.0,),
    )
    by_phase = {p: [s for s in shapes if s.phase == p] for p in ("prefill", "decode", "colocated")}
    # 256 experts divide over 32 or 64 GPUs (no redundancy) but not over 144
    assert {s.redundant_experts for s in by_phase["prefill"]} == {0, 32}
    assert {(s.nodes, s.redundant_experts) for s in by_phase["decode"]} == {
        (4, 0),
        (4, 32),
        (18, 32),
    }
    assert {s.redundant_experts for s in by_phase["colocated"]} == {0, 64}
    # prefill does not decode: no MTP, no batch limit
    assert all(s.mtp_acceptance == 0 and s.max_batch_per_gpu is None for s in by_phase["prefill"])
    # each decoding slot layout with and without MTP, with and without the limit
    assert len(by_phase["decode"]) == 3 * 2 * 2 and len(by_phase["colocated"]) == 2 * 2 * 2
    only = candidate_shapes(modes=("aggregated",), nodes={"colocated": (4,)}, micro_batches=(1,))
    assert {s.phase for s in only} == {"colocated"}
    with pytest.raises(InputError, match="modes"):
        candidate_shapes(modes=("both",))


def test_pruning_keeps_the_answer_of_searching_every_shape():
    workload = steady(20.0)
    # up to 32 units: an aggregated unit meets no 60 ms TPOT at any count (its decoding waits
    # through whole prefill steps), and searching it to 256 units is most of this test's time
    slo = dict(slo_ttft_p95_s=1.5, slo_tpot_p95_s=0.06, max_units=32)
    shapes = [
        Shape("prefill", 4, 32),
        Shape("prefill", 8, 64),
        Shape("decode", 4, 32),
        Shape("decode", 8, 64),
        Shape("decode", 18, 32),
        Shape("colocated", 4, 32),
        Shape("colocated", 8, 64),
    ]
    plan = plan_capacity(workload, **slo, shapes=shapes)
    assert any(not o.searched for o in plan.options)  # something was pruned
    # each shape alone (with the largest unit of the other side as the ample partner, as the
    # search takes)
    alone = {}
    for shape in shapes:
        partner = {"prefill": Shape("decode", 18, 32), "decode": Shape("prefill", 8, 64)}
        extra = [partner[shape.phase]] if shape.phase in partner else []
        try:
            single = plan_capacity(workload, **slo, shapes=[shape, *extra])
        except InputError:  # no fleet of this shape meets the SLOs
            continue
        alone[shape] = getattr(single, shape.phase)
    for phase in ("prefill", "decode", "colocated"):
        best = min(
            (o for s, o in alone.items() if s.phase == phase and o),
            key=lambda o: o.cost_usd,
            default=None,
        )
        chosen = getattr(plan, phase)
        assert (chosen is None) == (best is None)
        assert chosen is None or chosen.cost_usd == best.cost_usd
    for o in plan.options:
        if o.searched and o.meets_slo:
            assert o.units >= o.lower_bound_units
            assert o.units == alone[o.shape].units


def test_aggregated_wins_at_small_demand_and_disaggregated_at_large():
    # an aggregated unit's decoding waits through its whole prefill steps: at 2 requests/s a
    # TPOT p95 of 50 ms takes two units; at 0.5/s and 100 ms one does both
    slo = dict(slo_ttft_p95_s=2.0, slo_tpot_p95_s=0.1)
    shapes = [Shape("prefill", 4, 32), Shape("decode", 4, 32), Shape("colocated", 4, 32)]
    small = plan_capacity(steady(0.5), **slo, shapes=shapes)
    assert small.mode == "aggregated" and small.nodes == 4  # one unit does both
    assert small.disaggregated_cost_usd == 2 * small.cost_usd
    large = plan_capacity(steady(150.0, 120.0, prompt=(4000, 12000)), **slo, shapes=shapes)
    assert large.mode == "disaggregated", large.to_dict()
    assert large.colocated is None or large.colocated.cost_usd > large.cost_usd


def test_mtp_is_chosen_when_it_is_what_meets_a_tight_tpot():
    workload = steady(10.0)
    shapes = [Shape("prefill", 4, 32), Shape("decode", 4, 32), Shape("decode", 4, 32, 2, 0.85)]
    plan = plan_capacity(workload, slo_ttft_p95_s=2.0, slo_tpot_p95_s=0.03, shapes=shapes)
    assert plan.decode.shape.mtp_acceptance == 0.85
    plain = next(o for o in plan.options if o.shape == shapes[1])
    assert not plain.meets_slo  # its step at any batch is over 30 ms


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plan_from_a_steady_demand_writes_json_and_a_figure(tmp_path):
    done = cli(
        "--demand", "2000", "--hours", "0.1", "--scale", "1", "--modes", "disaggregated",
        "--prefill-nodes", "4", "--decode-nodes", "4,8", "--micro-batches", "2", "--mtp", "0.85",
        "--max-batch-per-gpu", "16", "-o", str(tmp_path), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload == json.loads((tmp_path / "plan.json").read_text())
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    assert payload["workload"] == "2,000 output tokens/s" and payload["colocated"] is None
    tried = {(o["nodes"], o["mtp_acceptance"], o["max_batch_per_gpu"]) for o in payload["options"]}
    assert (8, 0.85, 16.0) in tried and (4, 0.0, None) in tried
    # longer answers at the same output tokens/s: fewer, longer requests, more KV per request
    longer = cli(
        "--demand", "2000", "--lengths", "2000:2000", "--hours", "0.1", "--scale", "1",
        "--modes", "disaggregated", "--prefill-nodes", "4", "--decode-nodes", "4",
        "--micro-batches", "2", "--json",
    )  # fmt: skip
    assert longer.returncode == 0, longer.stderr
    assert json.loads(longer.stdout)["prefill"]["ttft_p95_s"] < payload["prefill"]["ttft_p95_s"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--modes", "both"], "--modes='both'"),
        (["--workload", "t.csv", "--hours", "2"], "--hours=2.0"),
        (["--micro-batches", "3"], "--micro-batches"),
        (["--max-batch-per-gpu", "x"], "--max-batch-per-gpu"),
        (["--mtp", "1"], "--mtp"),
        (["--demand", "5", "--workload", "x.csv"], "--workload and --demand"),
        (["--decode-nodes", "0"], "--decode-nodes"),
        (["--hours", "30"], "--hours"),
        (["--demand", "5", "--lengths", "100"], "--lengths"),
        (["--lengths", "100:10"], "--demand only"),
    ],
)
def test_plan_refuses_bad_options_in_one_line(args, named):
    done = cli(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and named in done.stderr


def test_a_burst_gets_the_fewest_units_not_its_five_minute_rate():
    # 70,000 requests (700 sampled) arrive in 5 minutes and decode for long after: their work
    # need not be done in those 5 minutes, so the fleet may be smaller than that rate asks
    from moeinfra.serving.perfmodel import PerfModel
    from moeinfra.serving.planner import DRAIN_S
    from moeinfra.serving.schedule import constant_schedule
    from moeinfra.serving.simulate import COMPLETED, SimConfig, simulate
    from moeinfra.serving.specs import Deployment, hardware

    rng = np.random.default_rng(1)
    n = 700
    burst = Workload(
        np.sort(rng.uniform(0.0, 300.0, n)),
        np.full(n, 1000),
        np.full(n, 3000),
        np.zeros(n, dtype=np.int64),
        100.0,
        300.0,
    )
    shapes = [Shape("prefill", 4, 32), Shape("decode", 4, 32)]
    plan = plan_capacity(burst, slo_ttft_p95_s=30.0, slo_tpot_p95_s=0.2, shapes=shapes)
    units = plan.decode.units
    five_minute_rate = 6  # the busiest 5 minutes' decode work / 300 s, at the fastest batch
    assert plan.decode.lower_bound_units <= units < five_minute_rate
    fewer = simulate(
        burst,
        constant_schedule(256, units - 1, 300.0, 4, 4),
        PerfModel(Deployment("prefill", 4, 32), hardware("h800")),
        PerfModel(Deployment("decode", 4, 32), hardware("h800")),
        SimConfig(drain_s=DRAIN_S),
    )
    done = fewer.status == COMPLETED
    assert not done.all() or np.percentile(fewer.tpot_s[done], 95) > 0.2


def test_shapes_that_cannot_be_planned_are_left_out_with_the_reason():
    # no decode shape holds DeepSeek-V3 on one H800 node: the prefill shapes have no partner
    with pytest.raises(InputError, match="no decode unit fits to pair it with"):
        plan_capacity(
            steady(2.0),
            slo_ttft_p95_s=2.0,
            slo_tpot_p95_s=0.05,
            shapes=[Shape("prefill", 4, 32), Shape("decode", 1, 0)],
        )
    # a batch limit below one sampled request (each stands for 100 here) could never admit one
    sampled = Workload(np.array([0.0, 1.0]), np.array([500, 500]), np.array([50, 50]),
                       np.zeros(2, dtype=np.int64), 100.0, 60.0)  # fmt: skip
    plan = plan_capacity(
        sampled,
        slo_ttft_p95_s=5.0,
        slo_tpot_p95_s=0.1,
        shapes=[Shape("prefill", 4, 32), Shape("decode", 4, 32), Shape("decode", 4, 32, 2, 0, 2.0)],
    )
    assert any("less than one sampled request" in why for why in plan.unfit)
    assert plan.decode.shape.max_batch_per_gpu is None
