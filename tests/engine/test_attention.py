"""Decode attention over the paged MLA cache: the dtype it computes in on the CPU."""

from __future__ import annotations

import torch

from moeinfra.engine import attention
from moeinfra.engine.attention import decode_attention, decode_dtype
from moeinfra.moe.config import tiny
from moeinfra.moe.mla import MLA, Latent, latent_query


def test_small_half_precision_decode_attends_in_float32():
    """A bfloat16 CPU cache's decode step attends in float32 while its gathered context is small
    (small bfloat16 matmuls cost several times their float32 ones there), in the cache's dtype
    once it is large, and float32 caches stay as they are. The float32 products come back in
    bfloat16 and are closer to a float64 reference than bfloat16's own."""
    c = tiny()
    width = c.kv_lora_rank + c.qk_rope_head_dim
    store = torch.randn(64, width, generator=torch.Generator().manual_seed(0)).bfloat16()
    slots = torch.arange(40).view(2, 20)
    assert decode_dtype(store, slots) == torch.float32
    assert decode_dtype(store.float(), slots) is None
    large = torch.zeros(attention.FLOAT32_DECODE_VALUES // width + 1, dtype=torch.int64)
    assert decode_dtype(store, large[None]) is None

    torch.manual_seed(1)
    mla = MLA(c).bfloat16()
    heads = c.num_attention_heads
    latent = Latent(
        torch.randn(2, heads, c.qk_nope_head_dim).bfloat16(),
        torch.randn(2, heads, c.qk_rope_head_dim).bfloat16(),
        torch.randn(2, c.kv_lora_rank).bfloat16(),
        torch.randn(2, c.qk_rope_head_dim).bfloat16(),
    )
    mask = torch.arange(20)[None, None, :] < torch.tensor([[[20]], [[13]]])
    with torch.no_grad():
        in_float32 = decode_attention(
            mla, latent_query(mla, latent, torch.float32), store, slots, mask
        )
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
