"""Checkpoint loading: config parsing, FP8 blocks, and one-line errors naming the file and tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine.checkpoint import CheckpointReader
from moeinfra.engine.fp8 import dequantize, quantize
from moeinfra.engine.hf_config import parse_config, read_config
from moeinfra.engine.registry import architecture, supported_model_types
from moeinfra.engine.tiny import init_tiny, random_weights, tiny_config
from moeinfra.errors import CheckpointError


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _file_of(path, name):
    """The safetensors file holding tensor ``name`` (sharded with an index, or one file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return path / json.loads(index.read_text())["weight_map"][name]
    return path / "model.safetensors"


def test_both_layouts_load_the_same_weights_and_generate_the_same(tiny_path, single_file_path):
    assert not (single_file_path / "model.safetensors.index.json").exists()
    sharded, single = CheckpointReader(tiny_path), CheckpointReader(single_file_path)
    assert sorted(sharded.names()) == sorted(single.names())
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert name in single and torch.equal(sharded.get(name), single.get(name))
    prompts = ["KV cache", "Prefill and decode are disaggregated"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    outs = [
        [o.outputs[0].token_ids for o in LLM(p).generate(prompts, greedy, use_tqdm=False)]
        for p in (tiny_path, single_file_path)
    ]
    assert outs[0] == outs[1]


def test_config_reads_deepseek_v3_keys(tiny_path):
    config = parse_config(read_config(tiny_path))
    assert config.model_type == "deepseek_v3"
    assert config.num_layers == 3 and config.first_k_dense_replace == 1
    assert config.num_moe_layers == 2
    b = config.block
    assert (b.num_routed_experts, b.num_expert_groups, b.groups_per_token) == (16, 4, 2)
    assert b.rope_scaling is not None and b.rope_scaling.factor == 40
    assert config.kv_latent_dim == 32 + 8  # kv_lora_rank + qk_rope_head_dim


def test_transformers5_rope_parameters_form_is_read_too():
    raw = tiny_config(1024)
    yarn = raw.pop("rope_scaling")
    raw["rope_parameters"] = {**yarn, "rope_type": "yarn", "rope_theta": 5000.0}
    del raw["rope_theta"], raw["rope_parameters"]["type"]
    config = parse_config(raw)
    assert config.block.rope_theta == 5000.0
    assert config.block.rope_scaling.original_max_position_embeddings == 4096


def test_registry_names_the_supported_architectures():
    assert "deepseek_v3" in supported_model_types()
    with pytest.raises(CheckpointError, match=r"model_type='llama' is not supported.*deepseek_v3"):
        architecture("llama")


def test_fp8_block_round_trip_within_fp8_error():
    w = torch.randn(300, 200) * 0.05
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    back = dequantize(q, scale)
    # e4m3 keeps 3 mantissa bits: relative error per element <= 2**-4 of the block's scale range
    err = (back - w).abs()
    block_max = w.abs().max()
    assert err.max() <= block_max * 2**-4
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(2, 2\).*needs \(3, 2\)"):
        dequantize(q, scale[:2])


@pytest.mark.parametrize("shards", [2, 1])
def test_fp8_checkpoint_loads_within_fp8_error_of_the_originals(tmp_path, shards):
    path = init_tiny(tmp_path / "fp8", tokenizer="bpe", fp8=True, shards=shards)
    raw = read_config(path)
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    originals = random_weights(tiny_config(raw["vocab_size"]), seed=0)
    reader = CheckpointReader(path)
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(f))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert stored[name].dtype == torch.float8_e4m3fn
    assert name + "_scale_inv" in stored
    quantized = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantized) > 50
    for n in quantized:
        loaded, original = reader.get(n), originals[n]
        assert loaded.dtype == torch.float32
        # per-element error of e4m3 with a per-block scale: <= 2**-4 * |original| + one subnormal
        # step of the block, bounded here by the tensor's largest magnitude
        bound = 2**-4 * original.abs() + original.abs().max() * 2**-9
        assert bool((loaded - original).abs().le(bound).all()), n
    # and the whole FP8 model generates
    out = LLM(path).generate("KV cache", use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_missing_shard_names_the_file_and_a_tensor(tiny_path, tmp_path):
    path = _copy(tiny_path, tmp_path)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        LLM(path)
    msg = str(err.value)
    assert "model-00002-of-00002.safetensors: shard missing" in msg
    assert "\n" not in msg


def test_single_file_missing_names_both_layouts(single_file_path, tmp_path):
    path = _copy(single_file_path, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model.safetensors.index.json and no model"):
        LLM(path)


def test_wrong_shape_names_the_tensor_and_both_shapes(layout_path, tmp_path):
    path = _copy(layout_path, tmp_path)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    shard = _file_of(path, name)
    tensors = load_file(shard)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, shard)
    with pytest.raises(
        CheckpointError, match=rf"tensor {name} has shape \[128, 31\], the config needs \[128, 32\]"
    ):
        LLM(path)


def test_missing_tensor_unknown_architecture_and_missing_tokenizer(layout_path, tmp_path):
    path = _copy(layout_path, tmp_path)
    index_path = path / "model.safetensors.index.json"
    gone = "model.layers.2.mlp.experts.7.up_proj.weight"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        del index["weight_map"][gone]
        index_path.write_text(json.dumps(index))
    else:
        tensors = load_file(path / "model.safetensors")
        del tensors[gone]
        save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"tensor model.layers.2.mlp.experts.7.up_proj.weight is missing"
    ):
        LLM(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(
        CheckpointError, match=r"config.json: model_type='mixtral' is not supported"
    ):
        LLM(path)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer.json: missing"):
        LLM(path)
    with pytest.raises(CheckpointError, match=r"model='.*nowhere' is not a folder"):
        LLM(tmp_path / "nowhere")


def test_missing_config_key_is_named(tiny_path, tmp_path):
    path = _copy(tiny_path, tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["kv_lora_rank"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"config.json: required key 'kv_lora_rank' is missing"
    ):
        LLM(path)


def test_init_tiny_refuses_to_overwrite_and_leaves_nothing_half_written(tmp_path):
    path = init_tiny(tmp_path / "t", tokenizer="bpe")
    with pytest.raises(ValueError, match="exists and is not empty"):
        init_tiny(path, tokenizer="bpe")
    with pytest.raises(ValueError, match="tokenizer='gpt2' is not allowed"):
        init_tiny(tmp_path / "u", tokenizer="gpt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    files = sorted(p.name for p in path.iterdir())
    assert files == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_only_the_ranks_own_experts_are_read(layout_path):
    """A rank's model holds the experts of its slots only (what EP loading promises)."""
    tiny_path = layout_path
    import numpy as np

    from moeinfra.eplb import rebalance
    from moeinfra.moe.expert_parallel import rank_experts

    raw = read_config(tiny_path)
    arch = architecture(raw["model_type"])
    config = arch.parse_config(raw, "config.json")

    class FakeComm:  # rank 1 of 4, as the loader sees it (no collective is run)
        rank, world_size, distributed, group = 1, 4, False, None
        recorder = None

    plan = rebalance(np.ones((2, 16)), 20, 4, 1, 4)
    reader = CheckpointReader(tiny_path)
    read = []
    original = reader.get
    reader.get = lambda name, *a, **k: (read.append(name), original(name, *a, **k))[1]
    arch.load(reader, config, plan, FakeComm(), torch.float32)
    experts_read = {
        (int(n.split(".")[2]), int(n.split(".")[5])) for n in read if ".mlp.experts." in n
    }
    expected = {(1 + j, e) for j in range(2) for e in rank_experts(plan, j, 1)}
    assert experts_read == expected


@pytest.mark.parametrize("shards, cpu", [(2, "native"), (1, "native"), (1, "avx2")])
def test_bfloat16_checkpoint_loads_as_bfloat16_and_tracks_float32(
    tmp_path, tiny_path, shards, cpu, request
):
    """Also on a CPU without oneDNN's bfloat16 path (``avx2``: forced), where it used to fail
    at the first projection."""
    from moeinfra.engine import EngineConfig, EngineCore
    from moeinfra.engine.kv_cache import StepCache
    from moeinfra.moe.mla import Segment

    path = init_tiny(tmp_path / "bf16", tokenizer="bpe", dtype="bfloat16", shards=shards)
    stored = load_file(next(path.glob("*.safetensors")))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    ids = torch.arange(20, 60)
    logits = {}
    if cpu == "avx2":
        request.getfixturevalue("avx2_only")
    for name, folder, dtype in (("bf16", path, "bfloat16"), ("fp32", tiny_path, "float32")):
        core = EngineCore(folder, EngineConfig(dtype=dtype, block_size=8, num_kv_blocks=8))
        assert core.cache.data.dtype == getattr(torch, dtype)
        step = StepCache(core.cache, {0: StepCache.slots_of(list(range(5)), 8)})
        hidden = core.model(ids, [Segment(0, 0, 40)], step, "none")
        logits[name] = core.model.logits(hidden)
    cos = torch.nn.functional.cosine_similarity(logits["bf16"], logits["fp32"], dim=-1)
    # the same function with weights and activations rounded to bf16 (8-bit mantissas); a token
    # whose expert choice flips under that rounding differs more
    assert cos.median() > 0.999 and cos.min() > 0.9
