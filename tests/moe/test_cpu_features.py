"""CPU capability checks and the fallbacks they choose (forced here on any CPU)."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from moeinfra.moe import cpu_features
from moeinfra.moe.layers import Linear, fused_linears, linear


def test_detected_features_are_torchs_own_answers():
    found = cpu_features.detect()
    assert found.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert found.avx512 == torch.cpu._is_avx512_supported()
    assert found.isa == torch.backends.cpu.get_cpu_capability()
    assert found.onednn_packs(torch.float32)
    assert found.model in found.describe() and "oneDNN bf16" in found.describe()
    assert cpu_features.AVX2_ONLY.describe().endswith("AMX no; oneDNN bf16 no)")


def test_half_precision_note_names_the_missing_path(avx2_only):
    assert cpu_features.half_precision_note(torch.float32) is None
    note = cpu_features.half_precision_note(torch.bfloat16)
    assert "no oneDNN bfloat16 path" in note and "AVX2-only CPU" in note


def test_bfloat16_linears_without_onednn_bfloat16_are_torchs_gemm(avx2_only):
    """On a CPU without oneDNN's bfloat16 path (the fixture makes oneDNN refuse bfloat16 as such
    a CPU does) every bfloat16 projection is ``F.linear``'s, bit for bit; float32 ones still
    take oneDNN's packed GEMM."""
    torch.manual_seed(0)
    x = torch.randn(16, 256)  # float32 from 2M multiply-adds on: oneDNN
    first, second = Linear(256, 512), Linear(256, 128)
    with torch.no_grad():
        half = x.bfloat16()
        first_h, second_h = first.bfloat16(), second.bfloat16()
        a, b = fused_linears(half, first_h, second_h)
        assert torch.equal(a, F.linear(half, first_h.weight))
        assert torch.equal(b, F.linear(half, second_h.weight))
        assert torch.equal(first_h(half), F.linear(half, first_h.weight))
        assert torch.equal(linear(half, second_h.weight), F.linear(half, second_h.weight))
        first.float()(x)
        assert first._packed is not None  # float32: packed for oneDNN as before


def test_bfloat16_experts_without_onednn_bfloat16_match_the_native_path(request):
    """The expert-parallel MoE layer in bfloat16, every CPU path (per-row, padded batches, one
    GEMM per slot): with the fallbacks forced, the output of the native run up to bfloat16
    rounding."""
    from moeinfra.eplb import rebalance
    from moeinfra.moe.config import tiny
    from moeinfra.moe.expert_parallel import ExpertParallelMoE
    from moeinfra.moe.layers import build_moe

    c = tiny()
    plan = rebalance(np.random.default_rng(1).random((1, 16)), 20, 4, 1, 1)
    ep = ExpertParallelMoE(build_moe(c, seed=3), plan).to(torch.bfloat16)
    inputs = [torch.randn(n, c.hidden_size).bfloat16() for n in (1, 12, 100, 4096)]
    with torch.no_grad():
        native = [ep(x).float() for x in inputs]
        request.getfixturevalue("avx2_only")
        fallback = [ep(x).float() for x in inputs]
    for want, got in zip(native, fallback, strict=True):
        assert (want - got).abs().max() <= 0.02 * want.abs().max()
