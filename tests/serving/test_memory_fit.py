"""Units that cannot hold DeepSeek-V3 in HBM are refused (#13 item 5's fit check)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moeinfra.errors import InputError
from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.planner import Shape, plan_capacity
from moeinfra.serving.scenario import build_scenario
from moeinfra.serving.specs import Deployment, hardware
from moeinfra.serving.workload import generate


def test_a_full_context_request_is_9_2_gb_of_kv():
    """128K tokens x (512 latent + 64 RoPE) values x 61 layers x 2 bytes, on one GPU."""
    use = PerfModel(Deployment("decode", 18), hardware("h800")).memory_use()
    assert use.kv_one_request == 131_072 * 576 * 61 * 2
    assert use.usable == 80e9 * 0.9 and use.hbm == 80e9


@pytest.mark.parametrize(
    ("gpu", "phase", "nodes", "redundant", "fits"),
    [
        # DeepSeek's own units (day 6: 4-node prefill, 18-node decode, 32 redundant, H800)
        ("h800", "prefill", 4, 32, True),
        ("h800", "decode", 18, 32, True),
        # SGLang's DeepSeek-V3 guide: one node of 8 H200 serves it, 8 H100 / H800 do not
        ("h200", "decode", 1, 0, True),
        ("h200", "prefill", 1, 0, True),
        ("h100", "decode", 1, 0, False),
        ("h800", "prefill", 1, 0, False),
        # 671B FP8 parameters over 16 GPUs leave room for a 128K request in decode, not beside
        # a 16K-token prefill step's activations
        ("h800", "decode", 2, 0, True),
        ("h800", "prefill", 2, 0, False),
    ],
)
def test_which_units_hold_the_model(gpu, phase, nodes, redundant, fits):
    perf = PerfModel(Deployment(phase, nodes, redundant_experts=redundant), hardware(gpu))
    use = perf.memory_use()
    assert use.fits is fits, use.describe()
    if fits:
        perf.check_fits()
    else:
        with pytest.raises(InputError, match=f"{nodes}-node {phase} unit .* does not fit: weights"):
            perf.check_fits()


def test_weights_shrink_with_the_unit_and_activations_grow_with_the_step():
    hw = hardware("h800")
    w = [PerfModel(Deployment("decode", n, 0), hw).memory_use().weights for n in (1, 2, 4, 8)]
    assert w == sorted(w, reverse=True)
    small, big = (
        PerfModel(Deployment("prefill", 4, tokens_per_gpu=t), hw).memory_use().activations
        for t in (4096, 16384)
    )
    assert (
        3.5 * small < big <= 4.0 * small + 1e9
    )  # per-token buffers, one FP32 logits row per prompt


def test_simulate_plan_and_model_refuse_or_leave_out_a_unit_that_does_not_fit(tmp_path):
    with pytest.raises(InputError, match="1-node prefill unit"):
        build_scenario(hours=0.1, prefill_dep=Deployment("prefill", 1, 0), fleet=(1, 1))
    day = generate(requests_per_s_at_peak=20.0, hours=0.05)
    plan = plan_capacity(
        day,
        slo_ttft_p95_s=3.0,
        slo_tpot_p95_s=0.1,
        shapes=[
            Shape("prefill", 4, 32),
            Shape("prefill", 2, 0),
            Shape("decode", 18, 32),
            Shape("decode", 1, 0),
        ],
    )
    assert {(o.phase, o.shape.nodes) for o in plan.options} == {("prefill", 4), ("decode", 18)}
    assert len(plan.unfit) == 2 and all("does not fit" in why for why in plan.unfit)
    assert plan.to_dict()["unfit"] == list(plan.unfit)
    done = subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", "model", "--nodes", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "does not fit" in done.stderr


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_activations_are_the_documented_buffers_counted_by_hand(phase):
    """Per micro-batch of n tokens: residual + normed hidden states (BF16), MLA's expanded q, k, v
    (BF16), and for the received expert rows (n x 8 x imbalance) the FP8 dispatch buffer with
    scales, the gate/up output and the BF16 combine buffer; plus FP32 logits of the LM-head rows
    (one per 4,096-token prompt in prefill, every request in decode)."""
    perf = PerfModel(Deployment(phase, 4 if phase == "prefill" else 18), hardware("h800"))
    n = 16_384 if phase == "prefill" else 256
    nb = n / 2
    rows = nb * 8 * perf.balance.imbalance
    per_micro_batch = (
        2 * nb * 7168 * 2
        + nb * 128 * (2 * (128 + 64) + 128) * 2
        + rows * (7392 + 2 * 2048 * 2 + 14_336)
    )
    head_rows = n / 4096 if phase == "prefill" else n
    expected = 2 * per_micro_batch + head_rows * 129_280 * 4
    assert perf.memory_use().activations == pytest.approx(expected, rel=1e-12)
