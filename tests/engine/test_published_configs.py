"""The engine and the serving model's architecture arithmetic (moeinfra.serving.arch) read
DeepSeek's published configs alike: the same layers, layer kinds and sizes, so what the engine
builds is what the parameter, KV and FLOP counts describe."""

import pytest

from moeinfra.engine.hf_config import PUBLISHED, published_config
from moeinfra.engine.registry import architecture
from moeinfra.serving import arch


@pytest.mark.parametrize("name", PUBLISHED)
def test_engine_and_arithmetic_read_a_published_config_alike(name):
    raw = published_config(name)
    config = architecture(raw["model_type"]).parse_config(raw, name)
    shape = arch.Architecture.from_config(raw, name)
    block = config.block
    assert config.num_layers == shape.num_layers
    assert config.vocab_size == shape.vocab
    assert (block.hidden_size, block.num_attention_heads, block.q_lora_rank) == (
        shape.hidden,
        shape.num_heads,
        shape.q_lora_rank,
    )
    assert (block.num_routed_experts, block.num_shared_experts, block.experts_per_token) == (
        shape.num_routed_experts,
        shape.num_shared_experts,
        shape.experts_per_token,
    )
    assert block.moe_intermediate_size == shape.moe_intermediate
    assert config.first_k_dense_replace == shape.num_dense_layers
    if config.indexer is not None:
        assert (config.indexer.heads, config.indexer.head_dim, config.indexer.topk) == (
            shape.index_n_heads,
            shape.index_head_dim,
            shape.index_topk,
        )
    if shape.v4:
        v4 = config.v4
        assert v4.compress_ratios == shape.compress_ratios
        assert v4.layer_kinds == shape.layer_kinds
        assert sum(v4.hash_layers) == shape.num_hash_layers
        assert (v4.head_dim, v4.rope_dim, v4.sliding_window) == (
            shape.head_dim,
            shape.qk_rope_head_dim,
            shape.sliding_window,
        )
        assert (v4.o_groups, v4.o_lora_rank, v4.hc_mult) == (
            shape.o_groups,
            shape.o_lora_rank,
            shape.hc_mult,
        )
        assert (v4.index_heads, v4.index_head_dim, v4.index_topk) == (
            shape.index_n_heads,
            shape.index_head_dim,
            shape.index_topk,
        )
    else:
        assert config.kv_latent_dim == shape.kv_lora_rank + shape.qk_rope_head_dim


def test_every_published_config_is_known_to_both():
    assert set(PUBLISHED) == set(arch.PUBLISHED.values())
