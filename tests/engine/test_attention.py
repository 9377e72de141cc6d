"""Decode attention over the paged MLA cache: the dtype it computes in on the CPU."""

from __future__ import annotations

import pytest
import torch

from moeinfra.engine import LLM, SamplingParams, attention
from moeinfra.engine.attention import decode_attention, decode_dtype
from moeinfra.moe import cpu_kernels
from moeinfra.moe.config import tiny
from moeinfra.moe.mla import MLA, Latent, latent_query


def _latent(c, rows: int) -> Latent:
    heads = c.num_attention_heads
    return Latent(
        torch.randn(rows, heads, c.qk_nope_head_dim).bfloat16(),
        torch.randn(rows, heads, c.qk_rope_head_dim).bfloat16(),
        torch.randn(rows, c.kv_lora_rank).bfloat16(),
        torch.randn(rows, c.qk_rope_head_dim).bfloat16(),
    )


def test_small_half_precision_decode_attends_in_float32():
    """A bfloat16 CPU cache's decode step attends in float32 while its products are small (small
    bfloat16 matmuls cost several times their float32 ones there), in the cache's dtype once
    they are large, and float32 caches stay as they are. The float32 products come back in
    bfloat16 and are closer to a float64 reference than bfloat16's own."""
    c = tiny()
    width = c.kv_lora_rank + c.qk_rope_head_dim
    store = torch.randn(64, width, generator=torch.Generator().manual_seed(0)).bfloat16()
    slots = torch.arange(40).view(2, 20)
    torch.manual_seed(1)
    mla, latent = MLA(c).bfloat16(), _latent(c, 2)
    assert decode_dtype(mla, latent, store, slots) == torch.float32
    assert decode_dtype(mla, latent, store.float(), slots) is None
    per_token = c.num_attention_heads * (width + c.kv_lora_rank)
    long = torch.zeros(2, attention.FLOAT32_DECODE_MACS // per_token // 2 + 1, dtype=torch.int64)
    assert decode_dtype(mla, latent, store, long) is None

    mask = torch.arange(20)[None, None, :] < torch.tensor([[[20]], [[13]]])
    with torch.no_grad():
        query = latent_query(mla, latent, torch.float32)
        in_float32 = decode_attention(mla, query, store, slots, mask)
        in_bfloat16 = decode_attention(mla, latent_query(mla, latent), store, slots, mask)
        exact = [t.double() for t in (latent.q_nope, latent.q_pe, latent.kv, latent.k_pe)]
        mla64 = MLA(c).double()
        mla64.load_state_dict(mla.state_dict())
        reference = decode_attention(
            mla64, latent_query(mla64, Latent(*exact)), store.double(), slots, mask
        )
    assert in_float32.dtype == in_bfloat16.dtype == torch.bfloat16
    error = (in_float32.double() - reference).abs().max()
    assert error <= (in_bfloat16.double() - reference).abs().max()
    assert error <= 0.02 * reference.abs().max()


def test_a_bfloat16_engine_decodes_small_steps_in_float32(tiny_path, monkeypatch):
    """Through the engine without moeinfra's CPU kernels: the tiny checkpoint's bfloat16 decode
    steps reach the attention with float32 queries (its prompt steps, with the model's), and none
    does where the limit is 0."""
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0")
    seen = []

    def recording(mla, query, *args):
        seen.append(query.dtype)
        return decode_attention(mla, query, *args)

    monkeypatch.setattr(attention, "decode_attention", recording)
    llm = LLM(tiny_path, dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert torch.float32 in seen
    seen.clear()
    monkeypatch.setattr(attention, "FLOAT32_DECODE_MACS", 0)
    llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert seen and set(seen) == {torch.bfloat16}  # the same steps, all in the model's dtype


def test_small_decode_steps_run_the_fused_kernel_with_the_torch_paths_tokens(
    tiny_path, monkeypatch
):
    """With the CPU kernels, the tiny checkpoint's small decode-only steps attend through
    ``fused_decode_attention`` (prompt steps do not), and greedy float32 generations equal those
    of the torch operators, kernels off."""
    calls = []
    fused = attention.fused_decode_attention

    def recording(mla, latent, store, plan):
        calls.append(plan.decode_lengths.tolist())
        return fused(mla, latent, store, plan)

    monkeypatch.setattr(attention, "fused_decode_attention", recording)
    prompts = [[5, 6, 7, 8, 9, 10], [8, 9], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_path)
    with_kernels = llm.generate(prompts, params, use_tqdm=False)
    assert cpu_kernels.available()
    layers = llm.model_config.num_layers
    assert len(calls) == 5 * layers and calls[0] == [7, 3, 41]  # every decode step, every layer
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0")
    calls.clear()
    without = LLM(tiny_path).generate(prompts, params, use_tqdm=False)
    assert not calls
    assert [o.outputs[0].token_ids for o in with_kernels] == [
        o.outputs[0].token_ids for o in without
    ]


def test_a_bfloat16_prompt_attends_in_pairs_only_where_the_cpu_has_them(tiny_path, request):
    """A long bfloat16 prompt (its chunk attends expanded, through ``prefill_attention``): on
    this CPU the kernel multiplies in bfloat16 pairs where it has AVX512-BF16, and on a CPU
    without (forced) widens to float32; the two runs' first tokens agree."""
    from moeinfra.moe import cpu_features

    if not cpu_kernels.available():
        pytest.skip("moeinfra's CPU kernels are not built here")
    calls = []
    kernel = torch.ops.moeinfra.prefill_attention

    def recording(q, k, v, scale, pairs):
        calls.append(pairs)
        return kernel(q, k, v, scale, pairs)

    request.getfixturevalue("monkeypatch").setattr(
        torch.ops.moeinfra, "prefill_attention", recording
    )
    prompt = [list(range(20, 220))]
    params = SamplingParams(temperature=0, max_tokens=1)
    llm = LLM(tiny_path, dtype="bfloat16", enable_prefix_caching=False)
    native = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert calls and set(calls) == {cpu_features.detect().avx512_bf16}
    calls.clear()
    request.getfixturevalue("avx2_only")
    forced = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert calls and set(calls) == {False}
    assert forced == native
