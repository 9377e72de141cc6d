"""DeepSeek's published cost by token position, V3.1-Terminus against V3.2-Exp on H800 (V3.2-Exp
report, Figure 3), against the model (docs/serving-model.md, "Cost by token position").

The model is never fitted to this figure: first principles (published kernel figures and DeepSeek's
own H800 profiles and kernel configurations) and the calibrations shipped before it. The aim is the
ratio V3.2 / V3.1 at 32K, 64K and 128K within 25%; the bands below are what the model reaches, each
configuration on its own.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from moeinfra.serving import perfmodel
from moeinfra.serving.calibration import load_calibration
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY
from moeinfra.serving.position_cost import (
    COMPARED_AT_K,
    DECODE_BATCH_PER_GPU,
    DEEPSEEK_DECODE_MTP_ACCEPTANCE,
    compare_with_published,
    deepseek_service_decode_unit,
    deepseek_service_models,
    position_cost,
    published_at,
    published_cost_by_position,
)
from moeinfra.serving.specs import DEEPSEEK_V3, DEEPSEEK_V32


def test_the_published_points_say_where_they_come_from():
    doc = published_cost_by_position()
    source = doc["source"]
    assert "deepseek-ai/DeepSeek-V3.2-Exp" in source["url"] and "Figure 3" in source["figure"]
    assert "pixel" in source["method"] and "USD" in source["uncertainty"]
    for phase in ("prefill", "decode"):
        for series in ("v3.1-terminus", "v3.2-exp"):
            points = np.array(doc[phase][series])
            assert points[-1, 0] == 128 and (np.diff(points[:, 0]) > 0).all()
    # V3.1-Terminus's dense attention: a straight line, to the digitising's 1-2 pixels
    for phase, pixel_usd in (("prefill", 0.0026), ("decode", 0.0090)):
        k = np.array([16, 32, 48, 64, 80, 96, 112, 128])
        usd = published_at(phase, "v3.1-terminus", k)
        fit = np.polyval(np.polyfit(k, usd, 1), k)
        assert np.abs(usd - fit).max() < pixel_usd


def test_published_ratios_at_32k_64k_128k():
    """What the figure says, as read: V3.2 costs 57/39/28% of V3.1 to prefill and 30/18/12% to
    decode at 32K/64K/128K (decode at 128K: "roughly 1/8", as a reader put it in
    deepseek-ai/DeepSeek-V3.2-Exp#41)."""
    c = compare_with_published()
    assert c["prefill"]["published_ratio"] == pytest.approx([0.575, 0.393, 0.283], abs=0.01)
    assert c["decode"]["published_ratio"] == pytest.approx([0.296, 0.177, 0.116], abs=0.01)


@pytest.fixture(scope="module")
def first_principles():
    return compare_with_published()


def test_model_has_the_published_shape(first_principles):
    """Both: V3.1's cost grows linearly with the position, V3.2's ratio to it falls at every step
    from 32K to 128K, V3.2 is cheaper from 16K on; V3.2's decode is nearly flat."""
    positions = np.array([16, 32, 64, 128], dtype=float) * 1024
    v31 = position_cost(DEEPSEEK_V3, positions)
    v32 = position_cost(DEEPSEEK_V32.with_kv_cache_dtype("fp8"), positions)
    for phase in ("prefill", "decode"):
        a, b = v31.phase(phase), v32.phase(phase)
        assert (b < a).all()
        assert (np.diff(b / a) < 0).all()
        slope = np.diff(a) / np.diff(positions)
        assert slope[-1] == pytest.approx(slope[-2], rel=0.05)  # linear at long context
    assert v32.decode_usd_per_mtok[-1] < 2 * v32.decode_usd_per_mtok[1]
    assert v31.decode_usd_per_mtok[-1] > 3 * v31.decode_usd_per_mtok[1]
    for phase in ("prefill", "decode"):
        assert (np.diff(first_principles[phase]["ratio"]) < 0).all()


def test_first_principles_against_the_published_ratios(first_principles):
    """First principles, DeepSeek's units, decoding as DeepSeek's service does (one MTP draft
    verified per request: FlashMLA's V3.2 production case, s_q = 2). Both phases within the 25%
    aim. Prefill (model / published 0.84, 0.84, 0.83): V3.2's advantage still overstated — per
    1K positions the model's V3.1 cost grows 6% slower than the published line, its V3.2 cost
    (the indexer) 21% slower, and V3.2 sits 23-25% below its line throughout. Decode 1.05, 0.96,
    0.98."""
    prefill = first_principles["prefill"]["model_over_published"]
    decode = first_principles["decode"]["model_over_published"]
    assert np.abs(np.array(prefill) - 1).max() < 0.25
    assert np.abs(np.array(decode) - 1).max() < 0.25
    assert prefill == pytest.approx([0.843, 0.836, 0.828], abs=0.01)
    assert decode == pytest.approx([1.045, 0.958, 0.978], abs=0.01)


def test_deepseek_decodes_with_one_mtp_draft_as_flashmla_publishes():
    """The decode configuration comes from DeepSeek's kernels, not from this figure: FlashMLA
    names V3.2's production decoding case 128 heads with s_q = 2 query tokens per request
    (tests/test_flash_mla_sparse_decoding.py, commit 082094b) and times its sparse decoding kernel
    (the 410 TFLOPS the model uses) at batch 128, s_q = 2; s_q is 1 without MTP (its README). Batch
    128 is DeepSeek's decode profile's. The acceptance is the DeepSeek-V3 report's."""
    assert DECODE_BATCH_PER_GPU == 128
    assert DEEPSEEK_DECODE_MTP_ACCEPTANCE == 0.85
    unit = deepseek_service_decode_unit()
    assert unit.mtp_acceptance == DEEPSEEK_DECODE_MTP_ACCEPTANCE and unit.nodes == 18
    assert DEFAULT_EFFICIENCY.sparse_decode_compute == pytest.approx(410 / 989)
    positions = np.array([32.0, 128.0]) * 1024
    for m in deepseek_service_models():
        assert np.array_equal(
            position_cost(m, positions).decode_usd_per_mtok,
            position_cost(m, positions, decode_dep=unit).decode_usd_per_mtok,
        )


def test_decode_ratio_does_not_depend_on_the_acceptance():
    """Both models make 1 + acceptance tokens a step, so the acceptance sets the USD level and
    not the ratio: 0.85 could not have been tuned to the figure."""
    ratios = [
        compare_with_published(mtp_acceptance=a)["decode"]["ratio"] for a in (0.3, 0.85, 0.95)
    ]
    assert ratios[0] == pytest.approx(ratios[1], rel=1e-12)
    assert ratios[2] == pytest.approx(ratios[1], rel=1e-12)


def test_decode_without_mtp_stays_outside_25_percent():
    """Without MTP (s_q = 1) every step reads each request's whole index-key cache (132 B x 61
    per token) for one token: V3.2's cost grows twice as fast with the position as published,
    model / published 1.19, 1.34, 1.48. The published V3.2 line (0.00076 USD per million tokens
    per 1K positions: 1.37 us of H800 time per token) is less than that read takes at H800's
    3.35 TB/s (8.2 MB per 1K positions: 2.46 us), so the published service cannot read it once
    per token made."""
    c = compare_with_published(mtp_acceptance=0.0)
    assert c["decode"]["model_over_published"] == pytest.approx([1.19, 1.34, 1.48], abs=0.03)
    k = np.array([32, 128])
    slope = np.diff(published_at("decode", "v3.2-exp", k))[0] / 96  # USD per Mtok per 1K
    seconds_per_token = slope / 1e6 / (2.0 / 3600)
    key_bytes = DEEPSEEK_V32.with_kv_cache_dtype("fp8").index_key_bytes_per_token_layer
    read_s = key_bytes * DEEPSEEK_V32.num_layers * 1024 / 3.35e12
    assert key_bytes == 132
    assert seconds_per_token == pytest.approx(1.37e-6, rel=0.03)
    assert read_s == pytest.approx(2.46e-6, rel=0.01) and seconds_per_token < 0.6 * read_s


def test_decode_within_25_percent_if_v31_decoded_without_mtp():
    """FlashMLA names V3.2's production decoding shape, not V3.1-Terminus's: with V3.1 decoding
    one token per step and V3.2 as published, the ratio is still within 25% (1.08, 1.02, 1.06)."""
    v31, v32 = deepseek_service_models()
    positions = np.array(COMPARED_AT_K, dtype=float) * 1024
    a = position_cost(v31, positions, decode_dep=deepseek_service_decode_unit(0.0))
    b = position_cost(v32, positions)
    published = published_at("decode", "v3.2-exp", COMPARED_AT_K) / published_at(
        "decode", "v3.1-terminus", COMPARED_AT_K
    )
    ratio = b.decode_usd_per_mtok / a.decode_usd_per_mtok / published
    assert np.abs(ratio - 1).max() < 0.25
    assert ratio == pytest.approx([1.08, 1.02, 1.06], abs=0.02)


def test_prefill_mha_rate_is_deepseeks_own_kernel_in_its_h800_profile():
    """The MHA-mode prefill attention rate is read off DeepSeek's H800 training profile (shipped
    as examples/data/deepseek_train_trace.json), not off the figure: its FlashAttention-3
    forward kernel for 192/128 head dimensions over one causal 4,096-token sequence of 128
    heads, beside a DeepEP dispatch on 20 SMs, whose blocks each fill an SM (the attention block
    takes the register file), so it ran on 112 SMs; the persistent GEMMs are launched on 112 SMs
    (grid = SMs), the attention on a grid of tiles (32 x 128) that fills whichever SMs are
    free."""
    trace = Path(__file__).parents[2] / "examples/data/deepseek_train_trace.json"
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    attention = [e for e in events if "Flash_fwd_kernel_traits<192, 128, 128" in e["name"]]
    assert [e["dur"] for e in attention] == [1248, 1199, 1280, 1221]
    for e in attention:
        assert e["args"]["grid"] == [32, 128, 1]  # 4,096 / 128 query tiles x 128 heads
        assert e["args"]["block"][0] * e["args"]["registers per thread"] > 64_000
        beside = [
            o for o in events
            if "dpsk::ep::internode" in o["name"]
            and o["ts"] < e["ts"] + e["dur"] and e["ts"] < o["ts"] + o["dur"]
        ]  # fmt: skip
        assert beside and all(o["args"]["grid"] == [20, 1, 1] for o in beside)
    gemms = {tuple(e["args"]["grid"]) for e in events if "fp8_ptp128c::Gemm" in e["name"]}
    assert (112, 1, 1) in gemms
    sms, seconds, share = (
        perfmodel.MHA_TRACE_SMS,
        perfmodel.MHA_TRACE_SECONDS,
        perfmodel.MHA_PREFILL_SHARE,
    )
    assert sms == 112
    assert seconds == pytest.approx(np.mean([e["dur"] for e in attention]) * 1e-6)
    assert share == pytest.approx(0.662, abs=0.001)
    assert DEFAULT_EFFICIENCY.mha_prefill_compute == perfmodel.MHA_PREFILL_SHARE


def test_calibrations_against_the_published_ratios():
    """The H800 calibrations (fitted on their own measured points, before this figure). The
    default rtp-llm-h800: both phases within 25% (prefill 0.84, 0.84, 0.83; decode 1.14, 1.05,
    1.02). deepseek-h800 (fitted on DeepSeek's H800 inference profiles, 2025-02) slows every GEMM
    by 1.21, the indexer's logits among them: prefill 0.91, 0.93, 0.94; its decode 1.33, 1.23,
    1.15, outside 25% at 32K — its all-to-all x1.35 (fitted on a decode step read as one token per
    request) lengthens the combine that V3.2's attention hides behind."""
    rtp = compare_with_published(eff=load_calibration("rtp-llm-h800").efficiency())
    for phase in ("prefill", "decode"):
        assert np.abs(np.array(rtp[phase]["model_over_published"]) - 1).max() < 0.25
    assert rtp["decode"]["model_over_published"] == pytest.approx([1.14, 1.05, 1.02], abs=0.02)
    c = compare_with_published(eff=load_calibration("deepseek-h800").efficiency())
    prefill = np.array(c["prefill"]["model_over_published"])
    assert np.abs(prefill - 1).max() < 0.25
    assert prefill == pytest.approx([0.907, 0.926, 0.940], abs=0.01)
    assert c["decode"]["model_over_published"] == pytest.approx([1.33, 1.23, 1.15], abs=0.02)


def test_compared_positions():
    assert COMPARED_AT_K == (32, 64, 128)
