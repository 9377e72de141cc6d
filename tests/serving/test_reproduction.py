"""DeepSeek's published day (REFERENCE.md) reproduced by the default scenario."""

import pytest

from moeinfra.serving.scenario import PUBLISHED, published_vs_simulated


def rel(a, b):
    return abs(a / b - 1.0)


def test_cost_and_nodes(day_result):
    t = day_result.totals
    assert rel(t["cost_usd"], 87_072) <= 0.005
    assert t["peak_nodes"] == 278
    assert t["avg_nodes"] == pytest.approx(226.75, rel=1e-9)


def test_tokens_and_cache_hits(day_result):
    t = day_result.totals
    assert rel(t["input_tokens"], 608e9) <= 0.02
    assert rel(t["output_tokens"], 168e9) <= 0.02
    assert rel(t["cache_hit_input_tokens"], 342e9) <= 0.02
    assert t["cache_hit_ratio"] == pytest.approx(0.563, abs=0.005)


def test_revenue_and_margin(day_result):
    t = day_result.totals
    assert rel(t["revenue_usd"], 562_027) <= 0.02
    assert abs(t["margin"] - 5.45) <= 0.15


def test_per_node_throughput(day_result):
    t = day_result.totals
    assert rel(t["prefill_tokens_per_s_per_node"], 73.7e3) <= 0.15
    assert rel(t["decode_tokens_per_s_per_node"], 14.8e3) <= 0.15


@pytest.fixture(scope="module")
def sized_for_published_speed():
    """The published day on a fleet the model sizes itself, DeepSeek-style: whole blocks of three
    4-node prefill units and one 18-node decode unit (the 30-node steps of the published node
    curve), as many as the more demanding phase needs to be 90% busy, decode units rated at
    DeepSeek's output speed (21 tokens/s, i.e. 47.6 ms per output token)."""
    from moeinfra.serving.scenario import build_scenario

    return (
        build_scenario(scale=400.0, fleet="auto", target=0.9, slo_tpot_s=1 / 21, block=(3, 1))
        .run()
        .totals
    )


def test_per_node_throughput_emerges_on_a_sized_fleet(sized_for_published_speed):
    """Given DeepSeek's speed and block structure, the model's batching and capacity give
    DeepSeek's decode throughput per node and fleet size."""
    t = sized_for_published_speed
    assert rel(t["decode_tokens_per_s_per_node"], 14.8e3) <= 0.15
    assert rel(t["avg_nodes"], 226.75) <= 0.15


@pytest.mark.xfail(
    strict=True,
    reason=(
        "the model's decode step, each kernel within 20% of its measurement, is 19-30% shorter "
        "than measured steps of running systems (ranks waiting in every all-to-all are not "
        "modelled), so it sizes a smaller fleet; the blocks tie prefill nodes to decode units, and "
        "the fewer prefill nodes each carry ~20% more than DeepSeek's (docs/serving-model.md, "
        "section 5)"
    ),
)
def test_prefill_throughput_per_node_emerges_on_a_sized_fleet(sized_for_published_speed):
    assert rel(sized_for_published_speed["prefill_tokens_per_s_per_node"], 73.7e3) <= 0.15


def test_fleet_carries_the_load_with_room_to_spare(day_result):
    """Throughput per node is achieved, not capped: nothing rejected, few requests left running."""
    req = day_result.requests()
    assert req["rejected"] == 0
    assert req["running"] / req["arrived"] < 0.002


def test_kv_length_per_output_token(day_result):
    assert rel(day_result.totals["mean_kv_len_per_output_token"], 4_989) <= 0.02


@pytest.mark.xfail(
    strict=True,
    reason=(
        "the performance model built from measured kernels gives a decode step of ~33 ms at the "
        "batch the published throughput implies, i.e. ~30 tokens/s, not the published 20-22; it "
        "is 8-30% faster than independent measurements of the same kind of deployment (see "
        "docs/serving-model.md, 'What the model does not reproduce')"
    ),
)
def test_mean_output_speed_published(day_result):
    assert 20.0 <= day_result.totals["mean_output_tokens_per_s"] <= 22.0


@pytest.mark.slow
def test_mean_output_speed_predicted_by_a_calibration_fitted_elsewhere():
    """Leave-one-out on the day: `rtp-llm-h800` is fitted on RTP-LLM's measured EP144 decode curve
    (Alibaba's replay of DeepSeek's system on H800), never on the day. On the default day and
    DeepSeek's fleet it gives 18.8 tokens/s per request, within 15% of the published 21, nothing
    rejected (docs/serving-model.md, "Shipped calibrations"; `deepseek-h800`, fitted on DeepSeek's
    two profiles alone, gives 11.9: its step grows faster with the batch than RTP-LLM measured)."""
    from moeinfra.serving.calibration import load_calibration
    from moeinfra.serving.scenario import build_scenario

    result = build_scenario(calibration=load_calibration("rtp-llm-h800")).run()
    assert 21 * 0.85 <= result.totals["mean_output_tokens_per_s"] <= 21 * 1.15
    assert result.requests()["rejected"] == 0


def test_published_table_covers_every_figure(day_result):
    rows = published_vs_simulated(day_result.totals)
    assert len(rows) == len(PUBLISHED)
    assert all(len(r) == 4 for r in rows)


def test_hourly_records_cost_their_nodes_at_the_rental_price(day_result):
    """Each hour costs its average nodes x 8 H800s x $2 per GPU-hour (DeepSeek's rental price);
    the day's total against DeepSeek's $87,072 is test_cost_and_nodes'."""
    hourly = day_result.hourly
    assert len(hourly) == 24
    for h in hourly:
        assert h["cost_usd"] == pytest.approx(h["nodes"] * 8 * 2.0)
    # the night trough of the node curve: 68 nodes from 03:30 to 06:30 (hours 16 and 17 fully)
    assert hourly[16]["nodes"] == pytest.approx(68.0)
    assert hourly[0]["nodes"] == pytest.approx(278.0)
