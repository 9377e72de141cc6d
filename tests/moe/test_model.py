"""Single-process model pieces: config presets, gate routing rule, MoE, MLA, decoder stages."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moeinfra.eplb import rebalance
from moeinfra.errors import InputError
from moeinfra.moe.block import build_decoder
from moeinfra.moe.config import MoEConfig, deepseek_v3, preset, tiny
from moeinfra.moe.expert_parallel import ExpertParallelMoE
from moeinfra.moe.gate import route
from moeinfra.moe.layers import build_moe
from moeinfra.moe.mla import KVCache, Segment, positions_of
from moeinfra.moe.runtime import ExpertParallelDecoder


def test_deepseek_v3_preset_matches_published_config():
    c = deepseek_v3()
    assert (c.hidden_size, c.moe_intermediate_size) == (7168, 2048)
    assert (c.num_routed_experts, c.num_shared_experts, c.experts_per_token) == (256, 1, 8)
    assert (c.num_expert_groups, c.groups_per_token) == (8, 4)
    assert c.routed_scaling_factor == 2.5 and c.scoring == "sigmoid"
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (128, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert preset("tiny") == tiny()


def test_deepseek_v3_parameter_count_is_671b():
    # 58 MoE layers + 3 dense layers (intermediate 18432) + embedding and output head (vocab 129,280).
    c = deepseek_v3()
    moe_layer = c.parameter_count()
    attention = (
        moe_layer - (c.num_routed_experts + 1) * 3 * 7168 * 2048 - c.num_routed_experts * 7168
    )
    total = 58 * moe_layer + 3 * (attention + 3 * 7168 * 18432) + 2 * 129_280 * 7168
    assert round(total / 1e9) == 671


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"groups_per_token": 5}, "groups_per_token=5 must be <= num_expert_groups=4"),
        (
            {"num_routed_experts": 18},
            "num_routed_experts=18 must be a multiple of num_expert_groups=4",
        ),
        ({"experts_per_token": 9}, "experts_per_token=9 must be <= groups_per_token"),
        ({"scoring": "relu"}, "scoring='relu'"),
        ({"hidden_size": 0}, "hidden_size=0"),
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim=3"),
        (
            {"num_expert_groups": 16, "groups_per_token": 4, "experts_per_token": 4},
            "needs >= 2 experts",
        ),
    ],
)
def test_bad_configs_rejected(changes, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("*", r"\*")):
        tiny().replace(**changes)
    with pytest.raises(InputError, match="preset='big'"):
        preset("big")


def _route_by_hand(logits, bias, top_k, groups, groups_per_token, scale, scoring="sigmoid"):
    """The rules of DeepSeek-V3's reference gate (``inference/model.py``, ``Gate.forward``)
    written out token by token: sigmoid or softmax scores; with a bias, groups ranked by the sum
    of their two best biased scores, without one by their best score; the top-k biased scores
    inside the kept groups; weights the unbiased scores, normalised (sum + 1e-20, as transformers)
    only with sigmoid scoring, times the scale."""
    x = logits.astype(np.float64)
    if scoring == "sigmoid":
        scores = 1 / (1 + np.exp(-x))
    else:
        scores = np.exp(x - x.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    n, e = scores.shape
    per_group = e // groups
    weights, indices = [], []
    for t in range(n):
        biased = scores[t] + (0.0 if bias is None else bias)
        members = [sorted(biased[g * per_group : (g + 1) * per_group]) for g in range(groups)]
        group_score = [m[-1] if bias is None else sum(m[-2:]) for m in members]
        keep = sorted(range(groups), key=lambda g: -group_score[g])[:groups_per_token]
        allowed = [i for i in range(e) if i // per_group in keep]
        chosen = sorted(allowed, key=lambda i: -biased[i])[:top_k]
        w = np.array([scores[t, i] for i in chosen])
        if scoring == "sigmoid":
            w = w / (w.sum() + 1e-20)
        weights.append(w * scale)
        indices.append(chosen)
    return np.array(weights), np.array(indices)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    groups_cfg=st.sampled_from([(8, 4, 8, 64), (4, 2, 4, 16), (1, 1, 3, 10), (8, 8, 6, 32)]),
    bias_scale=st.sampled_from([None, 0.0, 0.1, 2.0]),
    scoring=st.sampled_from(["sigmoid", "softmax"]),
)
def test_gate_matches_the_reference_rules_in_every_mode(seed, groups_cfg, bias_scale, scoring):
    groups, per_token, top_k, experts = groups_cfg
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(7, experts)) * 3).astype(np.float32)
    bias = None if bias_scale is None else (rng.normal(size=experts) * bias_scale)
    # float32 rounds scores closer than ~1e-7 to ties, broken differently from float64's order
    biased = torch.from_numpy(logits).sigmoid() if scoring == "sigmoid" else None
    if biased is None:
        biased = torch.from_numpy(logits).softmax(-1)
    biased = biased.double().numpy() + (0.0 if bias is None else bias.astype(np.float32))
    assume(np.diff(np.sort(biased, axis=-1), axis=-1).min() > 1e-6)
    w, i = route(
        torch.from_numpy(logits),
        None if bias is None else torch.from_numpy(bias.astype(np.float32)),
        top_k=top_k,
        num_groups=groups,
        groups_per_token=per_token,
        scaling_factor=2.5,
        scoring=scoring,
    )
    ref_bias = None if bias is None else bias.astype(np.float32).astype(np.float64)
    w_ref, i_ref = _route_by_hand(logits, ref_bias, top_k, groups, per_token, 2.5, scoring)
    assert np.array_equal(i.numpy(), i_ref)
    np.testing.assert_allclose(w.numpy(), w_ref, rtol=1e-5)
    if scoring == "sigmoid":
        np.testing.assert_allclose(w.sum(-1).numpy(), 2.5, rtol=1e-5)
    else:  # softmax weights are not normalised: less than the scale whenever top_k < experts
        assert (w.sum(-1).numpy() < 2.5).all()


def test_without_bias_groups_rank_by_their_best_score():
    """DeepSeek's reference without a bias: a group with one strong expert beats a group of two
    good ones (with a bias, the sum of the two best decides the other way)."""
    logits = torch.full((1, 8), -5.0)
    logits[0, 0] = 5.0  # group 0: one strong expert
    logits[0, 2:4] = 2.0  # group 1: two good ones (their sum 1.76 > 0.993 + 0.007)
    kw = dict(top_k=1, num_groups=4, groups_per_token=1, scaling_factor=1.0)
    assert route(logits, None, **kw)[1].tolist() == [[0]]
    assert route(logits, torch.zeros(8), **kw)[1].item() in (2, 3)


def test_scores_that_all_underflow_give_zero_weights_not_nan():
    logits = torch.full((2, 8), -1e4)
    w, _ = route(
        logits, torch.zeros(8), top_k=2, num_groups=4, groups_per_token=2, scaling_factor=2.5
    )
    assert torch.isfinite(w).all() and (w == 0).all()


def test_bias_selects_but_does_not_weigh():
    logits = torch.zeros(5, 16)
    bias = torch.zeros(16)
    bias[[3, 9]] = 1.0
    w, i = route(logits, bias, top_k=2, num_groups=4, groups_per_token=2, scaling_factor=1.0)
    assert sorted(i[0].tolist()) == [3, 9]
    assert torch.allclose(w, torch.full((5, 2), 0.5))  # unbiased scores are all sigmoid(0)


def test_group_limit_excludes_other_groups():
    # Expert 0 has the best single score, but with a bias its group's top-2 sum is the worst.
    logits = torch.full((1, 8), -5.0)
    logits[0, 0] = 5.0
    logits[0, 2:8] = 2.0
    w, i = route(
        logits, torch.zeros(8), top_k=2, num_groups=4, groups_per_token=2, scaling_factor=1.0
    )
    assert 0 not in i[0].tolist()


def test_moe_matches_dense_loop():
    c = tiny()
    moe = build_moe(c, seed=3)
    x = torch.randn(20, c.hidden_size)
    with torch.no_grad():
        w, idx = moe.gate(x)
        dense = torch.stack(
            [
                sum(
                    w[t, j] * moe.experts[int(idx[t, j])](x[t : t + 1])[0]
                    for j in range(c.experts_per_token)
                )
                for t in range(20)
            ]
        ) + moe.shared(x)
        assert torch.allclose(moe(x), dense, atol=1e-5)
        assert moe(x[:0]).shape == (0, c.hidden_size)


def test_mla_is_causal_and_split_sequences_read_the_cache():
    c = tiny()
    block = build_decoder(c).blocks[0]
    x = torch.randn(30, c.hidden_size)
    with torch.no_grad():
        full = block.attn(x, [Segment(0, 0, 30)])
        prefix = block.attn(x[:12], [Segment(0, 0, 12)])
        assert torch.allclose(full[:12], prefix, atol=1e-6)  # later tokens do not leak back
        cache = KVCache()
        a = block.attn.attend(
            block.attn.project(x[:12], positions_of([Segment(0, 0, 12)])),
            [Segment(0, 0, 12)],
            cache,
        )
        b = block.attn.attend(
            block.attn.project(x[12:], positions_of([Segment(0, 12, 18)])),
            [Segment(0, 12, 18)],
            cache,
        )
        assert torch.allclose(torch.cat([a, b]), full, atol=1e-5)


def test_single_process_expert_parallel_equals_reference():
    c = tiny()
    decoder = build_decoder(c, seed=1)
    plan = rebalance(np.random.default_rng(0).random((c.num_layers, 16)), 20, 4, 1, 1)
    model = ExpertParallelDecoder(decoder, plan)
    segments = [Segment(0, 0, 37), Segment(1, 0, 20), Segment(2, 0, 43)]
    x = torch.randn(100, c.hidden_size)
    with torch.no_grad():
        ref = decoder(x, segments)
    for mode in ("none", "prefill", "decode"):
        assert (model(x, segments, mode) - ref).abs().max() <= 1e-5, mode
    moe = build_moe(c)
    ep = ExpertParallelMoE(moe, rebalance(np.ones((1, 16)), 16, 4, 1, 1))
    with torch.no_grad():
        assert torch.allclose(ep(x), moe(x), atol=1e-5)
    with pytest.raises(InputError, match="plan has 1 layers"):
        ExpertParallelDecoder(decoder, rebalance(np.ones((1, 16)), 16, 4, 1, 1))
    with pytest.raises(InputError, match="num_experts=8"):
        ExpertParallelMoE(moe, rebalance(np.ones((1, 8)), 8, 4, 1, 1))


def test_config_dict_round_trip():
    c = tiny()
    assert MoEConfig(**c.to_dict()) == c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_packed_for_onednn_equals_f_linear_and_follows_weight_changes(dtype):
    """On the CPU at inference Linear runs oneDNN on a packed copy of its weight: the result of
    F.linear (float32 up to rounding, bfloat16 the same), and a changed weight is repacked."""
    from moeinfra.moe.layers import Linear, _to_onednn

    torch.manual_seed(0)
    layer = Linear(256, 8192).to(dtype)
    x = torch.randn(8, 256, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 0.0
    with torch.no_grad():
        assert _to_onednn(x, layer.weight) == torch.backends.mkldnn.is_available()
        for _ in range(2):
            expected = torch.nn.functional.linear(x, layer.weight)
            got = layer(x)
            assert (got.float() - expected.float()).abs().max() <= tol
            layer.weight.copy_(torch.randn_like(layer.weight))  # e.g. a checkpoint loaded later
        twin = copy.deepcopy(layer)  # as EP migration copies experts: packed anew
        assert (twin(x) - layer(x)).abs().max() == 0
    with torch.enable_grad():  # training: plain F.linear, gradients flow
        layer(x.float().to(dtype)).sum().backward()
    assert layer.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_equal_one_call_each_and_follow_weight_changes(dtype):
    """Projections of one input as one oneDNN GEMM over their stacked weights: each output is
    what its own Linear gives (to float32 rounding; bfloat16 outputs round alike up to one
    unit), a changed weight is stacked anew, a deep copy stacks its own."""
    from moeinfra.moe.layers import Linear, fused_linears

    torch.manual_seed(0)
    first, second = Linear(256, 8192).to(dtype), Linear(256, 320).to(dtype)
    x = torch.randn(8, 256, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 2**-7
    with torch.no_grad():
        for _ in range(2):
            a, b = fused_linears(x, first, second)
            assert a.shape == (8, 8192) and b.shape == (8, 320)
            for got, layer in ((a, first), (b, second)):
                expected = layer(x).float()
                assert (got.float() - expected).abs().max() <= tol * expected.abs().max()
            second.weight.copy_(torch.randn_like(second.weight))
        twin_first, twin_second = copy.deepcopy(first), copy.deepcopy(second)
        twin = fused_linears(x, twin_first, twin_second)
        pairs = zip(twin, fused_linears(x, first, second), strict=True)
        assert all((t - f).abs().max() == 0 for t, f in pairs)


def test_bfloat16_experts_on_the_cpu_take_a_step_without_rows():
    """A rank may get no routed row in a step (one request decoding on a unit of two ranks):
    the bfloat16 path answers with no rows, as the others do."""
    c = tiny()
    ep = ExpertParallelMoE(build_moe(c, seed=3), rebalance(np.ones((1, 16)), 16, 4, 1, 1))
    with torch.no_grad():
        out = ep.to(torch.bfloat16)(torch.zeros(0, c.hidden_size, dtype=torch.bfloat16))
    assert out.shape == (0, c.hidden_size)


def test_cpu_experts_pad_decode_batches_not_prefill_ones():
    """A decode step's few rows per slot go padded into two batched GEMMs; a prefill step's
    (8,192 routed rows over 32 slots) would pad megabytes of zeros, so they go to the grouped
    GEMM; float32's rows, twice as large, reach that size at half as many (4,096). The padded
    size counts the slots actually batched: 64 rows over 256 slots of DeepSeek-V3's hidden size
    gather 64 slots (1.8 MB of rows), not all 256 — but their weights (88 MB a slot in bfloat16)
    are not copied: the grouped GEMM reads them where they are. A few rows run one batch entry
    each while their slots' weights are small (16 rows of the 32-expert benchmark layer, 196 KB a
    slot in bfloat16), not with DeepSeek-V3's."""
    from moeinfra.moe.expert_parallel import (
        GATHERED_EXPERT_BYTES,
        _padded_batch_gemms,
        _padded_shape,
        _per_row_experts,
    )

    small_slot = 3 * 256 * 128
    for rows, padded in ((32, True), (2048, True), (4096, True), (8192, False)):
        counts = torch.bincount(torch.arange(rows) % 32, minlength=32)
        x = torch.zeros(rows, 256, dtype=torch.bfloat16)
        assert _padded_batch_gemms(x, counts, 2 * small_slot) is padded
        assert _padded_batch_gemms(x.float(), counts, 4 * small_slot) is (padded and rows < 4096)
    counts = torch.bincount(torch.arange(64) % 63 * 4, minlength=256)  # one slot gets two rows
    gathered, batch, width = _padded_shape(counts)
    assert (batch, width) == (64, 2) and gathered[:63].tolist() == list(range(0, 252, 4))
    deepseek_slot = 2 * 3 * 7168 * 2048
    x = torch.zeros(64, 7168, dtype=torch.bfloat16)
    assert _padded_batch_gemms(x, counts, GATHERED_EXPERT_BYTES // 64)  # 64 slots, copied
    assert not _padded_batch_gemms(x, counts, deepseek_slot)
    assert _per_row_experts(torch.zeros(16, 256), 4 * small_slot)
    assert not _per_row_experts(torch.zeros(17, 256), 4 * small_slot)
    assert not _per_row_experts(torch.zeros(1, 7168), deepseek_slot)
    assert _padded_shape(torch.ones(32, dtype=torch.int64))[:2] == (None, 32)  # all: no gather


def test_fused_projections_fall_back_when_one_cannot_join():
    """A projection kept in FP8, or a plain torch Linear, runs on its own."""
    from moeinfra.engine.fp8 import Fp8Linear
    from moeinfra.moe.layers import Linear, fused_linears

    x = torch.randn(2, 128, dtype=torch.bfloat16)
    first = Linear(128, 32).bfloat16()
    fp8 = Fp8Linear(torch.randn(16, 128).to(torch.float8_e4m3fn), torch.ones(1, 1))
    with torch.no_grad():
        for second in (fp8, torch.nn.Linear(128, 16, bias=False).bfloat16()):
            a, b = fused_linears(x, first, second)
            assert (a - first(x)).abs().max() == 0 and (b - second(x)).abs().max() == 0


def test_mla_absorbed_copies_follow_the_weight_and_are_not_copied():
    """The contiguous halves of ``wkv_b`` kept for CPU inference, per dtype: rebuilt when the
    weight changes (the other dtypes' dropped), dropped by a deep copy and by a move or cast,
    never used with gradients."""
    from moeinfra.moe.mla import MLA

    mla = MLA(tiny())
    with torch.no_grad():
        w_uk, w_uv_t = mla.absorbed_weights()
        assert w_uk.is_contiguous() and w_uv_t.is_contiguous()
        mla.wkv_b.weight.mul_(2)
        assert torch.equal(mla.absorbed_weights()[0], 2 * w_uk)
        assert copy.deepcopy(mla).__dict__["_absorbed"] == {}
        w_uk64, w_uv64 = mla.absorbed_weights(torch.float64)  # another dtype: kept beside
        assert torch.equal(w_uk64, (2 * w_uk).double()) and torch.equal(w_uv64, w_uv_t.double() * 2)
        assert mla.absorbed_weights()[0].dtype == torch.float32
        mla.wkv_b.weight.mul_(2)  # stale copies of every dtype go with the old weight
        mla.absorbed_weights()
        assert list(mla._absorbed) == [torch.float32]
        mla.double()
        assert mla._absorbed == {} and mla.absorbed_weights()[0].dtype == torch.float64
    assert mla.absorbed_weights()[0].requires_grad  # training: views of the parameter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 8, 100])
def test_cpu_experts_equal_the_grouped_gemm(tokens, dtype, monkeypatch):
    """On the CPU the experts run as batched GEMMs over the used slots (rows padded, shapes
    rounded up; up to 16 rows, one batch entry per row): the unpadded path's output (torch's
    grouped GEMM in float32, one GEMM per slot in bfloat16) to bfloat16 rounding (float32: to
    float32's), whether some slots get no rows (1, 3, 8 tokens)
    or every one does, including replicated experts (20 slots for 16 experts). The same routing
    on both sides: a near-tie that bfloat16 breaks another way than float32 would move a whole
    token."""
    from moeinfra.moe import expert_parallel

    c = tiny()
    torch.manual_seed(tokens)
    x = torch.randn(tokens, c.hidden_size).to(dtype)
    plan = rebalance(np.random.default_rng(1).random((1, 16)), 20, 4, 1, 1)
    ep = ExpertParallelMoE(build_moe(c, seed=3), plan).to(dtype)
    with torch.no_grad():
        padded = ep(x).float()
        monkeypatch.setattr(expert_parallel, "_padded_batch_gemms", lambda *args: False)
        grouped = ep(x).float()
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-5
    assert (padded - grouped).abs().max() <= tolerance * grouped.abs().max()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=12))
def test_slot_spans_leave_every_row_to_its_own_slot(counts):
    """Each slot's GEMM rounds its rows up to the bucket by reading on into later slots' rows;
    run in order, the last span over every row is its own slot's, no span passes the last row,
    and every span is a multiple of the bucket or (at the end) shorter than one."""
    from moeinfra.moe.expert_parallel import EXPERT_ROWS_BUCKET, _slot_spans

    total = sum(counts)
    owner = np.repeat(np.arange(len(counts)), counts)
    last = np.full(total, -1)
    for slot, start, n in _slot_spans(torch.tensor(counts), total):
        assert n > 0 and start + n <= total
        assert n % EXPERT_ROWS_BUCKET == 0 or n < EXPERT_ROWS_BUCKET
        assert owner[start] == slot
        last[start : start + n] = slot
    assert (last == owner).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_gemms_equal_each_slots_experts_on_its_rows_alone(dtype):
    """The rounded-up per-slot GEMMs give each row what its slot's expert gives it alone: slots
    with no rows, counts off the bucket, and a last slot split into a bucket multiple and the rest."""
    from moeinfra.moe.expert_parallel import _slot_gemms
    from moeinfra.moe.layers import swiglu

    torch.manual_seed(0)
    counts = torch.tensor([0, 37, 16, 0, 5, 61, 0, 29])
    slots, hidden, inter = len(counts), 64, 32
    w13 = (torch.randn(slots, 2 * inter, hidden) / 8).to(dtype)
    w2 = (torch.randn(slots, hidden, inter) / 8).to(dtype)
    rows = torch.randn(int(counts.sum()), hidden).to(dtype)
    with torch.no_grad():
        out = _slot_gemms(rows, counts, w13, w2, None).float()
    start = 0
    for slot, count in enumerate(counts.tolist()):
        if not count:
            continue
        x = rows[start : start + count].float()
        gate, up = (x @ w13[slot].float().T).chunk(2, dim=-1)
        want = swiglu(gate, up) @ w2[slot].float().T
        tolerance = 0.03 if dtype == torch.bfloat16 else 1e-5
        assert (out[start : start + count] - want).abs().max() <= tolerance * want.abs().max()
        start += count


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(1, 40)), max_size=10))
def test_positions_of_concatenates_each_segments_positions(spans):
    """Decode steps (every segment one token), prompt chunks and their mix; none at all."""
    segments = [Segment(seq, start, length) for seq, (start, length) in enumerate(spans)]
    want = [p for start, length in spans for p in range(start, start + length)]
    positions = positions_of(segments)
    assert positions.dtype == torch.int64 and positions.tolist() == want


def test_bfloat16_experts_past_the_padded_batch_train_on_the_cpu():
    """Enough rows for one GEMM per slot (no padding): with gradients wanted they take torch's
    grouped GEMM instead, which differentiates, to the same output."""
    c = tiny()
    plan = rebalance(np.random.default_rng(1).random((1, 16)), 20, 4, 1, 1)
    ep = ExpertParallelMoE(build_moe(c, seed=3), plan).to(torch.bfloat16)
    x = torch.randn(4096, c.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16).requires_grad_()
    with torch.no_grad():
        inference = ep(x).float()
    trained = ep(x)
    trained.float().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert (trained.detach().float() - inference).abs().max() <= 0.02 * inference.abs().max()
