"""Tight known answers for the serving model (issue #18), each worked from the formulas of
docs/serving-model.md with the preset's published constants, not by running another part of the
model to get the number."""

import numpy as np
import pytest

from moeinfra.serving.perfmodel import COMBINE_BYTES_PER_TOKEN, DISPATCH_BYTES_PER_TOKEN, PerfModel
from moeinfra.serving.perfmodel.deepseek_v3 import mla_projections
from moeinfra.serving.specs import Deployment, hardware

H800 = hardware("h800")


def test_a_one_node_units_all_to_all_is_nvlink_to_seven_peers():
    # One node of 8 GPUs: a token's 8 experts sit on min(8, 8) GPUs, 7 of them another GPU, all
    # over NVLink (160 GB/s, DeepEP's achieved share); nothing crosses RDMA. Per micro-batch of
    # 8,192 tokens (16,384 per GPU, two micro-batches).
    perf = PerfModel(Deployment("prefill", nodes=1), H800)
    eff = perf.eff
    bw = 160e9 * eff.nvlink / eff.comm_time
    assert H800.nvlink_gb_per_s == 160
    dispatch = 8192 * 7392 * 7 / bw + eff.comm_launch_s
    combine = 8192 * 14336 * 7 / bw + eff.comm_launch_s
    assert (DISPATCH_BYTES_PER_TOKEN, COMBINE_BYTES_PER_TOKEN) == (7392, 14336)
    b = perf.prefill_breakdown()
    moe = perf.model.num_dense_layers  # the first MoE layer
    assert b.parts["dispatch"][moe] == pytest.approx(2 * dispatch, rel=1e-12)
    assert b.parts["combine"][moe] == pytest.approx(2 * combine, rel=1e-12)
    assert b.parts["dispatch"][0] == 0.0  # dense layers exchange nothing


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_one_micro_batch_overlaps_nothing_and_two_overlap_by_the_rule(phase):
    def breakdown(mb):
        perf = PerfModel(
            Deployment(phase, nodes=4 if phase == "prefill" else 18, micro_batches=mb), H800
        )
        return perf.prefill_breakdown() if phase == "prefill" else perf.decode_breakdown(64, 4096)

    one, two = breakdown(1), breakdown(2)
    moe = one.parts["routed"].nonzero()[0][0]
    parts = {name: values[moe] for name, values in one.parts.items()}
    assert one.layer[moe] == pytest.approx(sum(parts.values()), rel=1e-12)  # everything in series
    assert (
        one.layer[0]
        == pytest.approx(parts_dense := sum(v[0] for v in one.parts.values()), rel=1e-12)
        and parts_dense > 0
    )
    # Two micro-batches: each exchange hides behind the other micro-batch's compute segment:
    # 2 * (max(mlp, dispatch) + max(attention, combine)) with per-micro-batch halves of the parts.
    half = {name: values[moe] / 2 for name, values in two.parts.items()}
    mlp = half["shared"] + half["routed"]
    attention = half["attn_proj"] + half["core_attn"] + half["gate"]
    expect = 2 * (max(mlp, half["dispatch"]) + max(attention, half["combine"]))
    assert two.layer[moe] == pytest.approx(expect, rel=1e-12)
    assert two.layer[moe] < sum(two.parts[name][moe] for name in two.parts)


def test_the_decode_step_and_its_breakdown_agree():
    # decode_step_s (vectorised, used by the simulator) and decode_breakdown (the CLI's table)
    # are separate code paths; one step is the same seconds either way.
    perf = PerfModel(Deployment("decode", nodes=18), H800)
    for batch, kv in ((1, 0), (64, 4989), (128, 4096), (7.5, 30000)):
        b = perf.decode_breakdown(batch, kv)
        assert float(perf.decode_step_s(batch, kv)) == pytest.approx(b.step_s, rel=1e-12)


def test_request_and_kv_imbalance_scale_the_slowest_rank():
    # A rank with 1.5x the mean requests and 2x the mean KV tokens runs batch 1.5 b with mean KV
    # (2 / 1.5) kv per request: the same step as a balanced unit at those figures.
    perf = PerfModel(Deployment("decode", nodes=18), H800)
    skewed = float(perf.decode_step_s(64, 4000, request_imbalance=1.5, kv_imbalance=2.0))
    assert skewed == pytest.approx(float(perf.decode_step_s(96, 4000 * 2 / 1.5)), rel=1e-12)
    assert skewed > float(perf.decode_step_s(64, 4000))


def test_prefill_core_attention_is_the_roofline_of_its_flops_and_kv_bytes():
    # Per micro-batch of nb tokens attending `keys` keys each: FLOPs 2 * heads * (qk + v) * nb * keys
    # (128 heads, qk 192, v 128) and KV read nb * 2 * (512 + 64) bytes (BF16 latent + rope);
    # time = attention_time * max(compute, bytes / (HBM * eff)), compute on the SM share the
    # all-to-all leaves while the other micro-batch's combine runs (it starts with the
    # projections), on every SM after: min(full / share, full + (combine - proj) * (1 - share)).
    perf = PerfModel(Deployment("prefill", nodes=4), H800)
    eff, m = perf.eff, perf.model
    assert (m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) == (128, 192, 128)
    assert m.kv_values_per_token_layer == 512 + 64
    for keys in (1000.0, 30_000.0):  # the combine outlasts the attention / ends early in it
        nb = 8192
        flops = 2 * 128 * (192 + 128) * nb * keys
        kv_bytes = nb * 2 * m.kv_values_per_token_layer
        b = perf.prefill_breakdown(16384, attn_keys_per_token=keys)
        proj, combine = b.parts["attn_proj"][10] / 2, b.parts["combine"][10] / 2
        full = flops / (H800.bf16_tflops * 1e12 * eff.mha_prefill_compute)
        share = eff.prefill_compute_sms
        compute = min(full / share, full + (combine - proj) * (1 - share))
        assert (compute == full / share) == (keys == 1000.0)
        expect = eff.attention_time * max(
            compute, kv_bytes / (H800.hbm_tb_per_s * 1e12 * eff.memory)
        )
        assert b.parts["core_attn"][0] == pytest.approx(2 * expect, rel=1e-12)
    # linear in the keys attended once compute-bound, while the combine outlasts it
    b = perf.prefill_breakdown(16384, attn_keys_per_token=1000.0)
    b2 = perf.prefill_breakdown(16384, attn_keys_per_token=2000.0)
    assert b2.parts["core_attn"][0] == pytest.approx(2 * b.parts["core_attn"][0], rel=1e-12)
    assert np.all(b2.parts["attn_proj"] == b.parts["attn_proj"])


def test_a_single_requests_kv_transfer_delays_its_decode_not_its_first_token():
    # One request of 8,192 prompt and 64 output tokens on an idle 1:1 fleet. Its latent KV,
    # 2 bytes x (512 + 64) x 61 layers = 70,272 bytes per token, crosses RDMA after the prefill.
    # Only the prefill unit's NIC differs between the two runs (a one-node prefill unit exchanges
    # over NVLink, so the NIC enters nothing else): the first token comes at the same time, the
    # last one later by exactly the extra transfer, 8,192 x 70,272 B x (1/25 - 1/50) / 1e9 s.
    from dataclasses import replace

    from moeinfra.serving.schedule import constant_schedule
    from moeinfra.serving.simulate import SimConfig, simulate
    from moeinfra.serving.workload import Workload

    assert PerfModel(Deployment("prefill", nodes=1), H800).model.kv_bytes_per_token == 70_272
    one = np.ones(1)
    workload = Workload(
        0.0 * one,
        8192 * one.astype(int),
        64 * one.astype(int),
        0 * one.astype(int),
        1.0,
        100.0,
        "one",
    )
    decode = PerfModel(Deployment("decode", nodes=18), H800)
    runs = []
    for nic_gb_per_s in (50.0, 25.0):
        hw = replace(H800, rdma_gb_per_s=nic_gb_per_s)
        prefill = PerfModel(Deployment("prefill", nodes=1), hw)
        schedule = constant_schedule(1, 1, 100.0, 1, 18)
        runs.append(
            simulate(
                workload, schedule, prefill, decode, SimConfig(tick_s=100.0, record_every_s=100.0)
            )
        )
    fast, slow = runs
    assert fast.status[0] == slow.status[0] == 0  # completed
    assert slow.ttft_s[0] == fast.ttft_s[0]
    extra = 8192 * 70_272 * (1 / 25 - 1 / 50) / 1e9
    assert extra == pytest.approx(0.011513, rel=1e-4)  # 575,668,224 B x 0.02 s/GB
    assert slow.finish_s[0] - fast.finish_s[0] == pytest.approx(extra, rel=1e-9)
    assert slow.tpot_s[0] - fast.tpot_s[0] == pytest.approx(extra / 63, rel=1e-9)


def test_block_scaling_rounds_up_to_whole_blocks_of_the_more_demanding_phase():
    from moeinfra.serving.schedule import utilisation_schedule

    # Target 0.5 over 900 s intervals: 450 unit-seconds of work keep one unit busy. One request per
    # interval carries the work, so the units needed are exact: prefill-heavy (7 prefill, 1 decode),
    # on a block boundary (6, 1), decode-heavy (1, 5). Blocks of (3 prefill, 1 decode) units:
    # ceil(7 / 3) = 3 blocks = (9, 3); ceil(6 / 3) = 2 blocks = (6, 2), not 3; max(1, 5) = 5 blocks.
    arrival = np.array([0.0, 900.0, 1800.0])
    prefill = np.array([7.0, 6.0, 1.0]) * 450.0
    decode = np.array([1.0, 1.0, 5.0]) * 450.0
    free = utilisation_schedule(arrival, prefill, decode, 2700.0, target=0.5)
    tied = utilisation_schedule(arrival, prefill, decode, 2700.0, target=0.5, block=(3, 1))
    assert [tuple(map(int, free.at(t))) for t in arrival] == [(7, 1), (6, 1), (1, 5)]
    assert [tuple(map(int, tied.at(t))) for t in arrival] == [(9, 3), (6, 2), (15, 5)]
    # node-seconds follow the units: (9 + 6 + 15) prefill units of 4 nodes, 900 s each
    assert tied.node_seconds() == (30 * 4 * 900.0, 10 * 18 * 900.0)


def test_a_request_finishing_mid_tick_is_in_the_batch_only_while_it_runs():
    from moeinfra.serving.schedule import constant_schedule
    from moeinfra.serving.simulate import SimConfig, simulate
    from moeinfra.serving.specs import deepseek_decode_unit, deepseek_prefill_unit
    from moeinfra.serving.workload import Workload

    prefill = PerfModel(deepseek_prefill_unit(), H800)
    decode = PerfModel(deepseek_decode_unit(), H800)
    assert decode.eff.decode_interrupt_s == decode.eff.decode_contention == 0.0
    # A needs 60 output tokens, B 100,000 (decoding throughout); both arrive at 0, 1-second ticks,
    # each recorded alone. A request joins the batch when its KV has arrived (first token + the
    # transfer of 1,000 tokens' KV over RDMA) and leaves it when its last token is out.
    w = Workload(np.zeros(2), np.array([1000, 1000]), np.array([60, 100_000]), np.zeros(2, int))
    res = simulate(
        w, constant_schedule(1, 1, 5.0), prefill, decode, SimConfig(1.0, record_every_s=1.0)
    )
    transfer = 1000 * prefill.model.kv_bytes_per_token / (H800.rdma_gb_per_s * 1e9)
    ready = res.ttft_s + transfer
    step0, step1 = res.decode_step_s[0, 0], res.decode_step_s[1, 0]
    requests = res.decode_batch_per_gpu[:, 0] * decode.gpus
    # tick 0: each runs from its arrival at the decode unit to 1 s
    assert requests[0] == pytest.approx((1 - ready[0]) + (1 - ready[1]), rel=1e-9)
    # tick 1: B for the whole second, A for the time its remaining tokens take at tick 0's step
    left = 59 - (1 - ready[0]) / step0
    assert 0 < left * step0 < 1
    assert requests[1] == pytest.approx(1 + left * step0, rel=1e-9)
    assert res.finish_s[0] == pytest.approx(1 + left * step1, rel=1e-9)
    assert requests[2] == pytest.approx(1.0, rel=1e-12)  # A is gone


def test_layer_rows_are_each_layers_parts_and_totals_in_milliseconds():
    from moeinfra.serving.perfmodel import LayerBreakdown

    breakdown = LayerBreakdown(
        phase="decode",
        parts={"attention": np.array([0.001, 0.002]), "dispatch": np.array([0.0005, 0.0])},
        compute=np.array([0.003, 0.004]),
        comm=np.array([0.0005, 0.0]),
        layer=np.array([0.003, 0.004]),
        head_s=0.0,
        overhead_s=0.0,
        step_s=0.007,
        tokens_per_gpu=1.0,
    )
    expected = [
        {
            "layer": 0,
            "attention": 1.0,
            "dispatch": 0.5,
            "compute_ms": 3.0,
            "comm_ms": 0.5,
            "layer_ms": 3.0,
        },
        {
            "layer": 1,
            "attention": 2.0,
            "dispatch": 0.0,
            "compute_ms": 4.0,
            "comm_ms": 0.0,
            "layer_ms": 4.0,
        },
    ]
    rows = breakdown.rows()
    assert [r["layer"] for r in rows] == [0, 1]
    for row, want in zip(rows, expected, strict=True):
        assert row == pytest.approx(want)


def test_plain_gemms_run_at_deepgemms_best_rate_and_mla_down_has_v3s_width():
    """GEMMs outside DeepGEMM's table (gate, dense MLP, LM head) run at 1,350 of the H800's 1,979
    FP8 TFLOPS when compute-bound; the MLA down projection of DeepSeek-V3 maps 7,168 to
    1,536 (q) + 512 (kv) + 64 (rope) = 2,112 columns."""
    perf = PerfModel(Deployment("prefill", 4), hardware("h800"))
    flops = 2 * 4096 * 7168 * 129280  # an LM head over 4,096 rows: far above the memory bound
    assert perf._gemm(flops, 7168 * 129280) == pytest.approx(flops / 1350e12)
    # DeepSeek-V3's four MLA projections for 1,024 rows, shapes [rows, k] x [k, n] by hand
    shapes = [
        ("mla_down", 1536 + 512 + 64, 7168),
        ("q_up", 128 * (128 + 64), 1536),
        ("kv_up", 128 * (128 + 128), 512),
        ("attn_out", 7168, 128 * 128),
    ]
    expected = sum(perf._deepgemm(role, 1024, n, k) for role, n, k in shapes)
    assert mla_projections(perf, 1024, 1024) == pytest.approx(expected, rel=1e-12)


def test_the_decode_gate_is_a_gemm_over_every_routed_expert():
    """At 8,192 requests per GPU (4,096 per micro-batch) the gate, [4096, 7168] x [7168, 256], is
    compute-bound: 2 x 4096 x 7168 x 256 FLOPs at 1,350 TFLOPS."""
    perf = PerfModel(Deployment("decode", 18), hardware("h800"))
    gate = perf._decode_parts(8192.0, 1000.0)[4]
    assert gate == pytest.approx(2 * 4096 * 7168 * 256 / 1350e12)
