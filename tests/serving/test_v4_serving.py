"""DeepSeek-V4 in the serving model: the presets from DeepSeek's published configs, KV bytes by
context (a bounded window, compressed entries and compressor state), decode and prefill by layer
kind, the memory fit, and the CLI (docs/serving-model.md, "DeepSeek-V4 in the performance
model")."""

import json
import subprocess
import sys

import numpy as np
import pytest

from moeinfra.errors import InputError
from moeinfra.serving.arch import CSA, HCA, SLIDING, published
from moeinfra.serving.calibration import load_calibration
from moeinfra.serving.perfmodel import INDEXER, PerfModel
from moeinfra.serving.perfmodel.deepseek_v4 import layer as v4_layer
from moeinfra.serving.planner import candidate_shapes
from moeinfra.serving.specs import (
    Deployment,
    fitting_redundant_experts,
    hardware,
    model,
)

H800 = hardware("h800")
NAMES = ("deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4-pro")
MILLION = 1 << 20


def decode_unit(name: str, dtype: str = "fp8", nodes: int = 18, **kw) -> PerfModel:
    m = model(name, dtype)
    dep = Deployment(
        "decode", nodes, fitting_redundant_experts(nodes, 8, m.num_routed_experts), **kw
    )
    return PerfModel(dep, H800, m)


@pytest.fixture(scope="module")
def decode():
    return {name: decode_unit(name) for name in NAMES}


def test_the_v4_presets_are_the_published_architectures():
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        m, a = model(name), published(name)
        assert m.v4 and m.arch == a and m.sparse
        assert (m.num_layers, m.hidden, m.num_routed_experts, m.experts_per_token) == (
            a.num_layers,
            a.hidden,
            a.num_routed_experts,
            a.experts_per_token,
        )
        assert m.num_dense_layers == 0 and m.num_expert_groups == 1
    assert not model("deepseek-v3.2").v4
    with pytest.raises(InputError, match="DeepSeek-V4"):
        model("deepseek-v3").from_architecture(published("deepseek-v3"))


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_kv_bytes_are_the_architectures_plus_compressor_state_and_bounded_by_the_affine_form(
    name, dtype
):
    m, a = model(name, dtype), published(name)
    for context in (1, 100, 128, 4096, 131_072, MILLION):
        exact = m.kv_bytes(context)
        assert exact == a.kv_bytes(context, dtype) + a.compressor_state_bytes
        bound = m.kv_bytes_per_request + context * m.kv_bytes_per_token
        assert exact <= bound + 1e-6
        # the bound is off by less than one window's entries per layer
        assert bound - exact < a.num_layers * a.sliding_window * a.entry_bytes(dtype)


def test_kv_at_1m_tokens_is_the_published_share_of_v32s():
    """The V4 model card: at 1M tokens of context V4-Flash needs 7% and V4-Pro 10% of V3.2's KV
    cache; counted from the configs (both caches in FP8, as DeepSeek stores them)."""
    v32 = model("deepseek-v3.2", "fp8").kv_bytes(MILLION)
    flash = model("deepseek-v4-flash", "fp8").kv_bytes(MILLION) / v32
    pro = model("deepseek-v4-pro", "fp8").kv_bytes(MILLION) / v32
    assert flash == pytest.approx(0.07, abs=0.01)
    assert pro == pytest.approx(0.10, abs=0.01)


def test_a_gpu_holds_far_more_long_requests_of_v4_than_of_v32(decode):
    v32 = decode["deepseek-v3.2"]
    for context in (131_072, MILLION):
        held = {n: p.kv_requests_per_gpu(context) for n, p in decode.items()}
        # KV per request alone would give 1/0.07 and 1/0.10; V4-Flash's lighter weights leave
        # more HBM to the cache, V4-Pro's heavier ones less
        assert held["deepseek-v4-flash"] > 14 * held["deepseek-v3.2"]
        assert held["deepseek-v4-pro"] > 5 * held["deepseek-v3.2"]
        assert held["deepseek-v3.2"] < held["deepseek-v3"]
    assert v32.kv_request_overhead_tokens == 0.0
    flash = decode["deepseek-v4-flash"]
    assert flash.kv_request_overhead_tokens == pytest.approx(
        flash.model.kv_bytes_per_request / flash.model.kv_bytes_per_token
    )


def test_the_memory_fit_reads_the_kv_of_one_full_context_request_and_fp4_experts(decode):
    flash = decode["deepseek-v4-flash"]
    use = flash.memory_use()
    assert use.fits and use.kv_one_request == flash.model.kv_bytes(MILLION)
    m = flash.model
    # FP4 routed slots: 0.53 bytes a weight, against V3's one
    routed = m.num_moe_layers * flash.balance.slots_per_gpu * m.expert_params
    assert flash.weight_bytes_per_gpu > routed * 0.53125
    assert flash.weight_bytes_per_gpu < decode["deepseek-v3.2"].weight_bytes_per_gpu


def test_decode_by_layer_kind_and_the_vectorised_step_agree(decode):
    flash = decode["deepseek-v4-flash"]
    kinds = flash.model.layer_kinds()
    for context in (64, 4096, 131_072):
        b = flash.decode_breakdown(32, context)
        assert b.step_s == pytest.approx(float(flash.decode_step_s(32, context)), rel=1e-12)
        assert INDEXER in b.parts
        first = {k: kinds.index(k) for k in (SLIDING, CSA, HCA)}
        # the window alone has no compressor or indexer; CSA's indexer is the largest
        assert b.parts[INDEXER][first[SLIDING]] == 0.0
        assert b.parts[INDEXER][first[CSA]] > b.parts[INDEXER][first[HCA]] > 0.0
    many = flash.decode_step_s(np.array([8.0, 32.0]), np.array([4096.0, 131_072.0]))
    assert many[1] == pytest.approx(float(flash.decode_step_s(32, 131_072)), rel=1e-12)


def test_v4_attention_grows_with_the_context_only_through_its_compressed_entries(decode):
    flash = decode["deepseek-v4-flash"]
    kinds = flash.model.layer_kinds()
    core = {c: flash.decode_breakdown(32, c).parts["core_attn"] for c in (2048, 32_768, MILLION)}
    window = kinds.index(SLIDING)
    assert core[2048][window] == core[MILLION][window]  # 128 entries at any context
    csa = kinds.index(CSA)
    assert core[32_768][csa] == core[MILLION][csa]  # index_topk entries from 2,048 x 4 on
    hca = kinds.index(HCA)
    assert core[2048][hca] < core[32_768][hca] < core[MILLION][hca]


def test_a_long_context_decode_step_is_cheaper_on_v4_than_on_v32(decode):
    for context in (131_072, MILLION):
        v32 = float(decode["deepseek-v3.2"].decode_step_s(32, context))
        assert float(decode["deepseek-v4-flash"].decode_step_s(32, context)) < v32
        assert float(decode["deepseek-v4-pro"].decode_step_s(32, context)) < v32


def test_prefill_by_layer_kind():
    m = model("deepseek-v4-pro", "fp8")
    dep = Deployment("prefill", 4, fitting_redundant_experts(4, 8, m.num_routed_experts))
    p = PerfModel(dep, H800, m)
    short = p.prefill_breakdown(attn_keys_per_token=1024)
    long = p.prefill_breakdown(attn_keys_per_token=65_536)
    assert long.step_s > short.step_s
    assert p.prefill_attention_weight(65_536) > p.prefill_attention_weight(1024) > 0
    assert p.prefill_seconds_per_token() > 0


def prefill_unit(name: str, dtype: str = "fp8", nodes: int = 8, **kw) -> PerfModel:
    m = model(name, dtype)
    dep = Deployment(
        "prefill", nodes, fitting_redundant_experts(nodes, 8, m.num_routed_experts), **kw
    )
    return PerfModel(dep, H800, m)


def test_a_prefill_micro_batch_reads_the_cache_once_and_a_decode_query_its_requests(
    index_logits_work,
):
    """A prefill chunk's queries score against the same index keys (the kernels take a block of
    keys for a tile of queries; vLLM gathers a chunk's keys once): the indexer's logits read the
    chunk's context once, not once per query. A chunk of N = 4,096 tokens ending a
    1,048,576-token prompt (mean context 1,046,528): 262,144 CSA index keys of 68 bytes (FP4)
    read once, plus one float32 logit written per query and key; decode reads each request's."""
    p = prefill_unit("deepseek-v4-flash")
    n, tokens = 4096, 1 << 20
    context = tokens - n / 2
    assert float(p.prefill_key_tokens(n, context)) == tokens
    # prompts whole in the micro-batch: its tokens and their cache hits
    assert float(p.prefill_key_tokens(n, n / 2)) == n
    assert float(p.prefill_key_tokens(n, 1000 + n / 2, cached_per_token=1000 / n)) == n + 1000
    seen = index_logits_work
    v4_layer(p, CSA, n, context)
    v4_layer(p, CSA, 16, context, requests=8)  # decode: 8 requests, 2 queries each
    flops, prefill_bytes = seen[0]
    assert flops == 2 * 64 * 128 * n * (context / 4)
    assert prefill_bytes == tokens / 4 * 68 + 4 * n * (context / 4)
    assert seen[1][1] == 8 * (context / 4) * 68 + 4 * 16 * (context / 4)


def test_the_cache_format_moves_a_v4_prefill_step_only_by_its_kv_bytes():
    """An 8-node V4-Pro prefill step of 1M-token prompts' chunks (mean context 512K): BF16 caches
    may cost it at most reading the extra bytes of one 1M-token request's KV once per micro-batch
    (counting the index keys once per query made the step 8.3 s in BF16 against 4.3 in FP8)."""
    steps = {}
    for dtype in ("fp8", "bf16"):
        p = prefill_unit("deepseek-v4-pro", dtype)
        steps[dtype] = p.prefill_breakdown(attn_keys_per_token=1 << 19, prompt_len=1 << 20).step_s
    extra = model("deepseek-v4-pro", "bf16").kv_bytes(MILLION) - model(
        "deepseek-v4-pro", "fp8"
    ).kv_bytes(MILLION)
    bound = 2 * extra / (H800.hbm_tb_per_s * 1e12 * p.eff.memory)
    assert 0 <= steps["bf16"] - steps["fp8"] <= bound, steps


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_v4s_prefill_weight_is_its_steps_attention_per_token(name):
    """The per-token weight that spreads a prefill step's attention over prompts of different
    lengths is the step's core attention and indexer per token of its micro-batch (the weights
    and the cache read once for it, shared by its tokens): on one micro-batch exactly."""
    p = prefill_unit(name, micro_batches=1)
    for keys in (1024.0, 65_536.0, 524_288.0):
        b = p.prefill_breakdown(attn_keys_per_token=keys, prompt_len=2 * keys)
        attention = b.parts["core_attn"].sum() + b.parts[INDEXER].sum()
        weight = float(p.prefill_attention_weight(keys))
        assert weight * p.dep.tokens_per_gpu == pytest.approx(attention, rel=1e-9)


def test_mtp_adds_a_window_layer():
    p = decode_unit("deepseek-v4-flash", mtp_acceptance=0.85)
    kinds = p.model.layer_kinds()
    assert len(kinds) == published("deepseek-v4-flash").num_layers + 1 and kinds[-1] == SLIDING
    b = p.decode_breakdown(16, 8192)
    assert b.step_s == pytest.approx(float(p.decode_step_s(16, 8192)), rel=1e-12)


def test_v4_pro_units_spread_384_experts():
    shapes = candidate_shapes(routed_experts=384)
    for shape in shapes:
        slots = 384 + shape.redundant_experts
        assert slots % (shape.nodes * 8) == 0


def test_no_v3_calibration_carries_to_v4():
    cal = load_calibration("rtp-llm-h800")
    with pytest.raises(InputError, match="--calibration none"):
        cal.with_model(model("deepseek-v4-flash"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moeinfra.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_model_takes_v4_on_first_principles_and_states_what_it_assumes():
    run = cli("model", "--model", "deepseek-v4-flash", "--phase", "decode", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["calibration"] == "none"
    assert out["model"]["name"] == "deepseek-v4-flash" and out["model"]["assumed"]
    assert out["model"]["kv_bytes_per_request"] > 0
    assert len(out["layers"]) == 43
    # a 4-node prefill unit holds one 1M-token request of V4-Pro in FP8, not in BF16
    run = cli("model", "--model", "deepseek-v4-pro", "--phase", "prefill")
    assert run.returncode == 2 and "1,048,576-token request's KV" in run.stderr
    run = cli(
        "model", "--model", "deepseek-v4-pro", "--phase", "prefill", "--kv-cache-dtype", "fp8"
    )
    assert run.returncode == 0, run.stderr
    assert "window 128 + compressed entries (CSA top 1,024, HCA all)" in run.stdout
    assert "KV cache fp8" in run.stdout
    run = cli("model", "--model", "deepseek-v4-pro", "--calibration", "rtp-llm-h800")
    assert run.returncode == 2
    assert run.stderr.count("\n") <= 1 and "--calibration none" in run.stderr


def test_v4_serves_a_million_tokens_and_the_memory_fit_checks_one():
    flash = decode_unit("deepseek-v4-flash")
    assert flash.model.max_context_tokens == MILLION
    use = flash.memory_use()
    assert use.context == MILLION and use.kv_one_request == flash.model.kv_bytes(MILLION)
    assert "1,048,576-token request" in use.describe()
    assert decode_unit("deepseek-v3.2").memory_use().context == 131_072


def test_a_prompt_longer_than_128k_is_v4s_only():
    run = cli("plan", "--model", "deepseek-v3.2", "--demand", "1000", "--lengths", "500000:1000")
    assert run.returncode == 2 and "--lengths" in run.stderr and "[1, 131072)" in run.stderr
    assert run.stderr.count("\n") <= 1


def test_v4_flash_serves_a_long_context_workload_on_a_fraction_of_v32s_fleet():
    """128K-token prompts (a mean of 131,071 tokens, the largest V3.2's 131,072-token context
    accepts; DeepSeek's cache-hit share), 1K answers, 100K output tokens/s for 15 minutes, FP8
    caches: V4-Flash's cheapest fleet costs well under half of V3.2's, in prefill (a quarter of the
    activated parameters, attention over compressed entries) and in decode. V3.2 clips its prompts
    at 131,071 tokens (about 31% of them, and their answers to 1 token), V4-Flash at 1,048,575:
    V4-Flash carries the heavier trace and still costs under half."""

    def plan(name):
        result = cli(
            "plan", "--demand", "100000", "--lengths", "131071:1000", "--hours", "0.25",
            "--scale", "20", "--micro-batches", "2", "--modes", "disaggregated",
            "--model", name, "--kv-cache-dtype", "fp8", "--calibration", "none", "--json",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    v32, flash = plan("deepseek-v3.2"), plan("deepseek-v4-flash")
    assert flash["model"]["name"] == "deepseek-v4-flash"
    assert flash["cost_usd"] < 0.5 * v32["cost_usd"]
    assert flash["decode"]["total_nodes"] < v32["decode"]["total_nodes"]


def plan_1m(name: str, dtype: str, *extra: str) -> subprocess.CompletedProcess:
    """``serve plan`` of 1M-token prompts (the largest mean V4's context accepts), cheaply: 2K
    output tokens/s for 15 minutes, each sampled request standing for 5."""
    return cli(
        "plan", "--demand", "2000", "--lengths", "1048575:1000", "--hours", "0.25",
        "--scale", "5", "--micro-batches", "2", "--modes", "disaggregated",
        "--model", name, "--kv-cache-dtype", dtype, "--calibration", "none", *extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, dtype",
    [("deepseek-v4-flash", "fp8"), ("deepseek-v4-pro", "fp8"), ("deepseek-v4-pro", "bf16")],
)
def test_the_planner_answers_1m_token_prompts_on_units_that_hold_one(name, dtype):
    """The plan's prefill (and decode) units fit one 1,048,576-token request beside their weights;
    the units that do not are left out, named, and the planner answers with the rest: V4-Pro has
    no 1- or 2-node unit, and in BF16 not its 4-node unit with 32 redundant experts either."""
    run = plan_1m(name, dtype, "--slo-ttft-p95", "10s", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    m = model(name, dtype)
    for side in ("prefill", "decode"):
        unit = out[side]
        dep = Deployment(side, unit["nodes"], unit["redundant_experts"], unit["micro_batches"])
        use = PerfModel(dep, H800, m).memory_use()
        assert use.fits and use.context == MILLION, use.describe()
    unfit = " ".join(out["unfit"])
    if name == "deepseek-v4-pro":
        assert "1-node prefill unit" in unfit and "2-node prefill unit" in unfit
        left_out = "4-node prefill unit, 32 redundant experts"
        assert (left_out in unfit) == (dtype == "bf16")
        assert "1,048,576-token request's KV" in unfit
    else:
        assert not unfit


def test_a_ttft_slo_no_searched_unit_reaches_is_refused_in_one_line_naming_the_closest():
    """At 1M-token prompts no 8-node V4-Pro prefill unit brings TTFT p95 under 2 s however many
    there are (a long prompt's own prefill takes longer): one line naming the closest."""
    run = plan_1m("deepseek-v4-pro", "fp8")
    assert run.returncode == 2 and run.stderr.count("\n") <= 1, run.stderr
    assert "no fleet meets the SLOs" in run.stderr
    assert "prefill: at best" in run.stderr and "8-node units, TTFT p95" in run.stderr
    assert "against 2 s" in run.stderr


def test_simulate_and_frontier_take_v4_and_list_its_assumptions():
    run = cli(
        "simulate", "--model", "deepseek-v4-flash", "--kv-cache-dtype", "fp8",
        "--hours", "0.25", "--scale", "400", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["calibration"] == "none" and out["requests"]["rejected"] == 0
    m = out["model"]
    assert m["name"] == "deepseek-v4-flash" and m["assumed"]
    assert m["decode_kv_request_overhead_tokens"] == pytest.approx(
        m["kv_bytes_per_request"] / m["kv_bytes_per_token"]
    )
    # DeepSeek's units, with the redundant experts that spread V4-Pro's 384 over 144 GPUs
    run = cli(
        "simulate", "--model", "deepseek-v4-pro", "--kv-cache-dtype", "fp8",
        "--hours", "0.25", "--scale", "400", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    front = cli("frontier", "--model", "deepseek-v4-flash", "--kv", "131072", "--json")
    assert front.returncode == 0, front.stderr
    assert json.loads(front.stdout)["model"]["assumed"]
