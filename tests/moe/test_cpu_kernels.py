"""moeinfra's fused CPU kernels against the torch operators they replace, and the fallback."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from moeinfra.engine.attention import decode_attention
from moeinfra.moe import cpu_kernels, gate, rope
from moeinfra.moe.config import tiny
from moeinfra.moe.expert_parallel import _padded_expert_gemms
from moeinfra.moe.layers import RMSNorm, combine_pairs
from moeinfra.moe.mla import MLA, Latent, latent_query

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def kernels():
    """Every test here needs the kernels: this machine (and CI's) has a C++ compiler."""
    assert cpu_kernels.available(), "moeinfra's CPU kernels did not build"


def _off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0")
    assert not cpu_kernels.available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_equals_torch(dtype, rows):
    """One rounding of ``x * rsqrt(mean(x^2) + eps) * w``, as ``F.rms_norm``: equal in half
    precision; in float32 the squares are summed in another order (a last-bit difference)."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=g) * 3).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    out = torch.ops.moeinfra.rms_norm(x, w, 1e-6)
    expected = F.rms_norm(x, (96,), w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:
        assert (out == expected).float().mean() >= (0.999 if rows > 100 else 1.0)
    strided = torch.cat([x, x], dim=1)[:, :96]  # same values, rows 192 apart
    assert rows == 1 or not strided.is_contiguous()
    assert torch.equal(torch.ops.moeinfra.rms_norm(strided, w, 1e-6), out)


def test_float64_and_gradients_stay_with_torch():
    """The kernels compute in float32: float64 inputs, and inputs autograd needs, are not theirs."""
    assert not cpu_kernels.usable(torch.ones(2, dtype=torch.float64))
    assert not cpu_kernels.usable(torch.ones(2), torch.ones(2, requires_grad=True))
    with torch.no_grad():
        assert cpu_kernels.usable(torch.ones(2), torch.ones(2, requires_grad=True))
        x = torch.randn(3, 8, dtype=torch.float64)
        expected = F.rms_norm(x, (8,), torch.ones(8, dtype=torch.float64), 1e-6)
        assert torch.equal(RMSNorm(8).double()(x), expected)


def test_rms_norm_module_uses_the_kernel_only_outside_autograd(monkeypatch):
    calls = []
    real = torch.ops.moeinfra.rms_norm

    class Spy:
        def __getattr__(self, name):
            assert name == "rms_norm"
            return lambda *a: calls.append(1) or real(*a)

    monkeypatch.setattr(torch.ops, "moeinfra", Spy())
    norm = RMSNorm(32)
    x = torch.randn(3, 32)
    with torch.no_grad():
        norm(x)
    assert calls == [1]
    y = norm(x.requires_grad_())  # training: torch's operators, with their gradient
    y.sum().backward()
    assert calls == [1] and x.grad is not None


def _mla_case(dtype, requests, context, seed=0, heads=None):
    c = tiny()
    if heads is not None:
        c = dataclasses.replace(c, num_attention_heads=heads)
    torch.manual_seed(seed)
    mla = MLA(c).to(dtype)
    heads, width = c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim
    slots_total = requests * context + 7
    # the cache's rows sit inside wider ones (DeepSeek-V3.2 keeps its index key beside them)
    wide = torch.randn(slots_total, width + 16).to(dtype)
    store = wide[:, :width]
    slots = torch.randperm(slots_total)[: requests * context].view(requests, context)
    lengths = torch.randint(1, context + 1, (requests,))
    lengths[0] = context
    # the queries are views of one projection, as MLA's are
    q = torch.randn(requests, heads, c.qk_nope_head_dim + c.qk_rope_head_dim).to(dtype)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    return mla, Latent(q_nope, q_pe, None, None), store, slots, lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "requests,context,heads,threads",
    [(1, 1, None, None), (1, 37, None, None), (3, 64, None, None), (9, 20, None, None),
     (3, 16, 8, 8), (5, 16, 8, 16), (3, 16, 16, 16), (2, 16, 7, 5), (2, 150, None, None)],
)  # fmt: skip
def test_mla_decode_equals_the_absorbed_attention_over_gathered_rows(
    dtype, requests, context, heads, threads
):
    """Read in place through the slots, each request up to its length, in float32: equal to
    the torch path (gather, masked absorbed attention in float32) up to float rounding; also
    with a request's heads split over more threads than heads (8 heads, 3 requests, 8 threads:
    4 groups of 2 heads); over contexts of several of the kernel's 64-row passes (150 rows: the
    running softmax rescales what it summed when a later pass brings a larger score)."""
    mla, latent, store, slots, lengths = _mla_case(dtype, requests, context, heads=heads)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _check_mla_decode(dtype, mla, latent, store, slots, lengths)
    finally:
        torch.set_num_threads(before)


def _check_mla_decode(dtype, mla, latent, store, slots, lengths):
    context = slots.shape[1]
    mask = (torch.arange(context)[None, :] < lengths[:, None])[:, None]
    with torch.no_grad():
        w_uk, w_uv_t = mla.absorbed_weights(torch.float32)
        out = torch.ops.moeinfra.mla_decode(
            latent.q_nope, latent.q_pe, w_uk, w_uv_t, store, slots, lengths, mla.scale, dtype
        )
        query = latent_query(mla, latent, torch.float32)
        heads_out = _heads_output(mla, query, store, slots, mask)
    assert out.dtype == dtype and out.shape == heads_out.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), heads_out.float(), rtol=tol, atol=tol)


def _heads_output(mla, query, store, slots, mask):
    """The attention's per-head output before ``wo``: decode_attention with ``wo`` the identity."""
    wo = mla.wo
    mla.wo = torch.nn.Identity()
    try:
        out = decode_attention(mla, query, store.float(), slots, mask)
    finally:
        mla.wo = wo
    return out.view(query.shape[0], mla.heads, -1)


def _causal_reference(q, k, v, scale):
    """Masked softmax attention in float32: query i of n sees keys up to m - n + i."""
    n, m = q.shape[0], k.shape[0]
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * scale
    mask = torch.arange(m)[None, :] <= (torch.arange(n) + m - n)[:, None]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)


PREFILL_DTYPES = [*DTYPES, "bfloat16 without pairs"]


@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
@pytest.mark.parametrize(
    "n,m,heads,dq,dv",
    [(1, 1, 1, 16, 16), (5, 5, 2, 64, 32), (70, 200, 3, 96, 32), (130, 130, 4, 192, 128),
     (64, 129, 2, 24, 40), (3, 67, 1, 7, 5), (200, 333, 2, 65, 80)],
)  # fmt: skip
def test_prefill_attention_equals_masked_softmax_attention(dtype, n, m, heads, dq, dv):
    """A chunk of n queries at the end of m keys (a prompt after a cached prefix), causal, over
    several of the kernel's 64-row blocks of queries and keys, with keys and values as views of
    one expanded tensor (as MLA's expanded path makes them), value widths of 64s, 16s and
    neither, odd widths and key counts (bfloat16 pairs padded); bfloat16 both in pairs (on a CPU
    with AVX512-BF16) and widened to float32, as on a CPU without."""
    pairs = dtype != "bfloat16 without pairs"
    dtype = dtype if pairs else torch.bfloat16
    torch.manual_seed(n + m)
    kv = torch.randn(m, heads, dq + dv).to(dtype)
    k, v = kv[..., :dq], kv[..., dq:]
    q = torch.randn(n, heads, dq).to(dtype)
    out = torch.ops.moeinfra.prefill_attention(q, k, v, dq**-0.5, pairs)
    assert out.dtype == dtype and out.shape == (n, heads, dv)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(
        out.float(), _causal_reference(q, k, v, dq**-0.5), rtol=tol, atol=tol
    )


def test_prefill_attention_rejects_what_it_cannot_read():
    q, k, v = torch.randn(4, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 4)
    attend = torch.ops.moeinfra.prefill_attention
    with pytest.raises(RuntimeError, match="more queries than keys"):
        attend(torch.randn(7, 2, 8), k, v, 1.0)
    with pytest.raises(RuntimeError, match="disagree on heads"):
        attend(q, k[:, :1], v, 1.0)
    with pytest.raises(RuntimeError, match="of one dtype"):
        attend(q, k.double(), v, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        attend(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), 1.0)
    assert attend(q[:0], k, v, 1.0).shape == (0, 2, 4)


def test_mla_decode_rejects_what_it_cannot_read():
    mla, latent, store, slots, lengths = _mla_case(torch.float32, 2, 8)
    w_uk, w_uv_t = mla.absorbed_weights(torch.float32)
    q, f32 = (latent.q_nope, latent.q_pe), torch.float32
    decode = torch.ops.moeinfra.mla_decode
    with pytest.raises(RuntimeError, match="one query per request"):
        decode(*q, w_uk, w_uv_t, store, slots[:1], lengths[:1], 1.0, f32)
    with pytest.raises(RuntimeError, match="float32 absorbed weights"):
        decode(*q, w_uk.double(), w_uv_t, store, slots, lengths, 1.0, f32)
    with pytest.raises(RuntimeError, match="disagree"):
        decode(*q, w_uk[:, :-1], w_uv_t, store, slots, lengths, 1.0, f32)
    with pytest.raises(RuntimeError, match=r"lengths must lie in \[1, 8\], got 9"):
        decode(*q, w_uk, w_uv_t, store, slots, torch.tensor([9, 1]), 1.0, f32)
    with pytest.raises(RuntimeError, match="lengths must lie"):
        decode(*q, w_uk, w_uv_t, store, slots, torch.zeros_like(lengths), 1.0, f32)
    with pytest.raises(RuntimeError, match="a slot outside the store"):
        decode(*q, w_uk, w_uv_t, store[:3], slots, lengths, 1.0, f32)
    none = decode(q[0][:0], q[1][:0], w_uk, w_uv_t, store, slots[:0], lengths[:0], 1.0, f32)
    assert none.shape == (0, mla.heads, mla.config.v_head_dim)


def _experts(dtype, hidden=64, inter=32, slots=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(slots, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(slots, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [None, 0.5])
def test_expert_rows_equal_the_per_row_batched_gemms(dtype, limit):
    """Runs of one slot's rows (sorted by slot, some slots without rows), SwiGLU (with DeepSeek-V4's
    clamp) and the down projection: the torch path's intermediate roundings, so half-precision
    results equal it; float32 up to the order of the sums."""
    w13, w2 = _experts(dtype)
    counts = torch.tensor([2, 0, 1, 3, 0, 1])
    rows = torch.randn(int(counts.sum()), 64, generator=torch.Generator().manual_seed(1))
    rows = rows.to(dtype)
    out = torch.ops.moeinfra.expert_rows(rows, torch.repeat_interleave(counts), w13, w2, limit)
    with torch.no_grad():
        expected = _padded_expert_gemms(rows, counts, w13, w2, limit)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(out, expected, rtol=0.02, atol=2e-3)
        assert (out == expected).float().mean() > 0.95


def test_expert_rows_reject_a_slot_they_do_not_hold():
    w13, w2 = _experts(torch.float32)
    with pytest.raises(RuntimeError, match="slot 6 outside the 6 slots"):
        torch.ops.moeinfra.expert_rows(torch.randn(2, 64), torch.tensor([0, 6]), w13, w2, None)


def test_expert_rows_read_each_rows_own_slot():
    """Rows of one slot apart from each other (not sorted) each use their own slot's weights."""
    w13, w2 = _experts(torch.float32)
    rows = torch.randn(4, 64)
    slots = torch.tensor([3, 1, 3, 0])
    out = torch.ops.moeinfra.expert_rows(rows, slots, w13, w2, None)
    for i, s in enumerate(slots.tolist()):
        gate_, up = (rows[i] @ w13[s].t()).chunk(2)
        torch.testing.assert_close(out[i], (F.silu(gate_) * up) @ w2[s].t(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 7, 200])
@pytest.mark.parametrize(
    "groups,bias,normalize", [(4, True, None), (1, True, False), (4, False, None)]
)
def test_route_equals_torch(monkeypatch, tokens, groups, bias, normalize):
    """Sigmoid scores, the selection bias, group-limited top-k (sum of a group's two best with a
    bias, its best without), weights unbiased, normalised and scaled: the same experts in the
    same order and the same weights up to float rounding (random scores have no ties)."""
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, 32, generator=g)
    b = torch.randn(32, generator=g) * 0.3 if bias else None
    kw = dict(
        top_k=4,
        num_groups=groups,
        groups_per_token=min(2, groups),
        scaling_factor=2.5,
        normalize=normalize,
    )
    weights, indices = gate.route(logits, b, **kw)
    _off(monkeypatch)
    expected_weights, expected_indices = gate.route(logits, b, **kw)
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_route_orders_equal_scores_by_expert_index():
    logits = torch.zeros(1, 8)
    logits[0, [5, 2, 6]] = 1.0
    weights, indices = gate.route(
        logits, None, top_k=3, num_groups=1, groups_per_token=1, scaling_factor=1.0
    )
    assert indices.tolist() == [[2, 5, 6]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conjugate", [False, True])
def test_rope_equals_the_complex_product(monkeypatch, dtype, conjugate):
    """Also for a conjugated table (DeepSeek-V4 rotates its outputs back with ``cis.conj()``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g).to(dtype)
    cis = torch.polar(torch.ones(5, 8), torch.randn(5, 8, generator=g) * 3)
    if conjugate:
        cis = cis.conj()
    out = rope.rotate_cis(x, cis)
    _off(monkeypatch)
    expected = rope.rotate_cis(x, cis)
    tol = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (0.01, 0.01), torch.float16: (1e-3, 1e-3)}
    torch.testing.assert_close(out, expected, rtol=tol[dtype][0], atol=tol[dtype][1])


def test_without_a_compiler_the_torch_operators_run(tmp_path):
    """No compiler: a warning, ``available()`` False, and a model still runs (torch operators)."""
    code = (
        "import warnings, torch\n"
        "from moeinfra.moe import cpu_kernels\n"
        "from moeinfra.moe.layers import RMSNorm\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(cpu_kernels.available())\n"
        "print(any('could not be built' in str(w.message) for w in caught))\n"
        "with torch.no_grad():\n"
        "    print(round(RMSNorm(8)(torch.ones(2, 8)).sum().item(), 3))\n"
    )
    env = {**os.environ, "CXX": "no-such-compiler", "MOEINFRA_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "16.0"]
    assert not list(tmp_path.glob("kernels/*.so"))


def test_the_library_is_built_once_and_anew_when_it_does_not_load(tmp_path, monkeypatch):
    """Cached under ``$MOEINFRA_CACHE/kernels``: a second build() is the same file, not a new
    compile; ``rebuild`` (what loading a truncated library falls back to) compiles it again. A
    build leaves the newest KEPT_LIBRARIES libraries of earlier sources there, with their locks."""
    monkeypatch.setenv("MOEINFRA_CACHE", str(tmp_path))
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    earlier = [kernels / f"moeinfra_cpu_{n:016x}.so" for n in range(cpu_kernels.KEPT_LIBRARIES + 2)]
    for age, path in enumerate(earlier):  # the first the newest
        path.write_bytes(b"an earlier build")
        (kernels / f".{path.stem}.lock").touch()
        os.utime(path, (time.time() - 60 * (age + 1),) * 2)
    first = cpu_kernels.build()
    built_at = first.stat().st_mtime_ns
    assert first.parent == kernels and first.suffix == ".so"
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == built_at
    kept = earlier[: cpu_kernels.KEPT_LIBRARIES - 1]
    assert sorted(kernels.glob("*.so")) == sorted([first, *kept])
    assert sorted(kernels.glob(".*.lock")) == sorted(
        kernels / f".{p.stem}.lock" for p in [first, *kept]
    )
    first.write_bytes(b"truncated")
    assert cpu_kernels.build(rebuild=True) == first and first.stat().st_size > 10_000


def test_the_cache_key_follows_the_source_torch_the_command_and_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEINFRA_CACHE", str(tmp_path))
    command = ["g++", "-O3"]
    base = cpu_kernels.library_path(command)
    assert cpu_kernels.library_path(["g++", "-O2"]) != base
    source = tmp_path / "k.cpp"
    source.write_text(cpu_kernels.SOURCE.read_text() + "// edited\n")
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "SOURCE", source)
        assert cpu_kernels.library_path(command) != base
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.0")
        assert cpu_kernels.library_path(command) != base
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : sse2")
        assert cpu_kernels.library_path(command) != base
    assert cpu_kernels.library_path(command) == base


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_rows_with_combine_weights_sum_each_tokens_pairs(dtype):
    """Pairs ``token * k + j`` read their token's row; the output is each token's pairs summed
    with its gate weights, rounded as ``combine_pairs`` rounds them: the sort, the per-pair rows
    and the weighted sum of the expert-parallel path in one."""
    w13, w2 = _experts(dtype)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(3, 64, generator=g).to(dtype)
    pair_slots = torch.tensor([4, 0, 2, 1, 4, 5])  # 3 tokens, k = 2, in pair order
    weights = torch.rand(3, 2, generator=g) * 2
    out = torch.ops.moeinfra.expert_rows(tokens, pair_slots, w13, w2, None, weights)
    pairs = torch.ops.moeinfra.expert_rows(
        tokens.repeat_interleave(2, 0), pair_slots, w13, w2, None
    )
    expected = combine_pairs(pairs.view(3, 2, 64), weights)
    assert out.shape == tokens.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    else:
        assert (out == expected).float().mean() >= 0.97
        torch.testing.assert_close(out, expected, rtol=0.02, atol=2e-3)
    with pytest.raises(RuntimeError, match="combine weights"):
        torch.ops.moeinfra.expert_rows(tokens, pair_slots, w13, w2, None, weights[:2])


def test_one_rank_few_pairs_run_fused_with_the_combine(monkeypatch):
    """An expert-parallel layer on one rank: a few tokens' pairs take the fused path (no sort,
    no per-pair rows) and give the unfused path's output; more pairs than the kernel's limit do not."""
    import numpy as np

    from moeinfra.eplb import rebalance
    from moeinfra.moe.expert_parallel import ExpertParallelMoE
    from moeinfra.moe.layers import build_moe

    config = tiny()
    moe = build_moe(config, seed=4)
    plan = rebalance(np.ones((1, config.num_routed_experts)), config.num_routed_experts, 1, 1, 1)
    layer = ExpertParallelMoE(moe, plan, 0)
    x = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, indices = layer.gate(x)
        routed = layer.dispatch(x, weights, indices)
        assert routed.order is None and routed.pair_slots is not None
        fused = layer.finish_combine(routed, layer.combine(routed, layer.compute_experts(routed)))
        wide = torch.randn(40, config.hidden_size)
        assert layer.dispatch(wide, *layer.gate(wide)).order is not None
        monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0")
        routed = layer.dispatch(x, weights, indices)
        assert routed.pair_slots is None
        unfused = layer.finish_combine(routed, layer.combine(routed, layer.compute_experts(routed)))
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(fused, moe(x) - moe.shared(x), rtol=1e-5, atol=1e-6)
