"""DeepSeek-V3.2 (sparse attention) against ``transformers``' DeepseekV32ForCausalLM on a tiny
checkpoint whose ``index_topk`` (16) is below most prompts plus outputs: logits within 1e-4, greedy
generation token for token on 1, 2 and 4 ranks with chunked prefill, prefix sharing, preemption and
live EPLB — and a check that dense attention would fail the same comparison."""

from __future__ import annotations

import pytest
import torch

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine.hf_config import published_config, read_config
from moeinfra.engine.kv_cache import PagedKVCache, StepCache
from moeinfra.engine.registry import architecture
from moeinfra.engine.tiny import TINY_INDEXER, init_tiny
from moeinfra.errors import CheckpointError
from moeinfra.moe.mla import Segment

from .conftest import PROMPTS, check_greedy, edit_config, hf_greedy, one_rank_model

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LOGIT_TOL = 1e-4
TOPK = TINY_INDEXER["index_topk"]


@pytest.fixture(scope="module")
def v32_path(tmp_path_factory):
    return init_tiny(tmp_path_factory.mktemp("ckpt") / "v32", tokenizer="bpe", arch="deepseek_v32")


@pytest.fixture(scope="module")
def hf_v32(v32_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(v32_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def v32_prompts(v32_path):
    from moeinfra.engine.tokenizer import Tokenizer

    tok = Tokenizer(v32_path)
    return [tok.encode(p) for p in PROMPTS]


def _dense(hf_model, topk):
    """Set every transformers indexer's top-k (a top-k past the context is dense attention)."""
    for layer in hf_model.model.layers:
        layer.self_attn.indexer.index_topk = topk


@pytest.fixture(scope="module")
def v32_reference(hf_v32, v32_prompts):
    return hf_greedy(hf_v32, v32_prompts, MAX_TOKENS)


def test_most_requests_attend_sparsely(v32_prompts):
    """The comparison means something: most prompts plus outputs are longer than index_topk."""
    longer = [len(ids) + MAX_TOKENS > TOPK for ids in v32_prompts]
    assert sum(longer) >= 0.7 * len(longer)
    assert any(len(ids) > TOPK for ids in v32_prompts)  # sparse already within a prompt


def test_logits_match_transformers_over_chunks_and_decode(v32_path, hf_v32):
    arch, config, model = one_rank_model(v32_path)
    ids = [(7 * i) % 1000 + 3 for i in range(60)]
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 4), 64, 4)
    step = StepCache(cache, {0: StepCache.slots_of(list(range(63, 47, -1)), 4)})
    # a dense first chunk, a chunk crossing index_topk, then sparse decode steps
    parts = [model(torch.tensor(ids[:10]), [Segment(0, 0, 10)], step, "none")]
    parts.append(model(torch.tensor(ids[10:50]), [Segment(0, 10, 40)], step, "none"))
    for i in range(50, 60):
        parts.append(model(torch.tensor([ids[i]]), [Segment(0, i, 1)], step, "none"))
    ours = model.logits(torch.cat(parts))
    with torch.no_grad():
        ref = hf_v32(torch.tensor([ids])).logits[0]
        _dense(hf_v32, 10**6)
        dense = hf_v32(torch.tensor([ids])).logits[0]
        _dense(hf_v32, TOPK)
    assert (ours - ref).abs().max() < LOGIT_TOL
    assert ref.abs().max() > 5
    # dense attention differs from DSA past index_topk, not before it
    assert (dense[:TOPK] - ref[:TOPK]).abs().max() < LOGIT_TOL
    assert (dense[TOPK:] - ref[TOPK:]).abs().max() > 100 * LOGIT_TOL


def test_dense_attention_would_fail_the_greedy_comparison(hf_v32, v32_prompts, v32_reference):
    _dense(hf_v32, 10**6)
    try:
        dense = hf_greedy(hf_v32, v32_prompts, MAX_TOKENS)
    finally:
        _dense(hf_v32, TOPK)
    assert dense != v32_reference


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 24, "max_num_seqs": 8},
        {"overlap": "prefill", "max_num_batched_tokens": 24},
    ],
    ids=["plain", "chunked-prefix-preempt", "overlap-prefill"],
)
def test_one_rank_greedy_equals_transformers(v32_path, v32_prompts, v32_reference, options):
    llm = LLM(v32_path, **options)
    outputs = llm.generate(v32_prompts, GREEDY, use_tqdm=False)
    check_greedy(outputs, v32_reference, v32_prompts)
    if "num_kv_blocks" in options:
        assert llm._core.scheduler.num_preemptions > 0
        assert any(o.num_cached_tokens > 0 for o in outputs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "ranks, options",
    [
        (2, {"overlap": "auto", "redundant_experts": 2, "max_num_batched_tokens": 32}),
        (4, {"overlap": "auto", "redundant_experts": 4, "eplb_interval": 3, "eplb_window": 4}),
    ],
    ids=["ep2-redundant-overlap-chunked", "ep4-redundant-overlap-rebalance"],
)
def test_spawned_unit_greedy_equals_transformers(
    v32_path, v32_prompts, v32_reference, ranks, options
):
    with LLM(v32_path, ranks=ranks, timeout_s=240, **options) as llm:
        outputs = llm.generate(v32_prompts, GREEDY, use_tqdm=False)
    check_greedy(outputs, v32_reference, v32_prompts)


def test_cache_holds_the_index_key_and_its_bytes_follow_the_formula(v32_path):
    raw = published_config("deepseek-v3.2-exp")
    arch = architecture(raw["model_type"])
    config = arch.parse_config(raw, "config.json")
    # DeepSeek-V3.2 in bf16: (512 latent + 64 RoPE key + 128 index key) x 2 B x 61 layers
    assert arch.kv_layout(config, torch.bfloat16, 64).bytes_per_token == 85_888
    tiny_raw = read_config(v32_path)
    tiny = arch.parse_config(tiny_raw, "config.json")
    layout = arch.kv_layout(tiny, torch.float32, 4)
    cache = PagedKVCache(layout, num_blocks=5, block_size=4)
    assert cache.nbytes == layout.bytes_per_token * 5 * 4
    assert cache.part(0, "index_k").shape == (20, TINY_INDEXER["index_head_dim"])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"index_topk": None}, "required key 'index_topk' is missing"),
        ({"index_topk": 0}, "index_topk=0 must be an integer > 0"),
        ({"index_n_heads": 2.5}, "index_n_heads=2.5 must be an integer > 0"),
        ({"index_head_dim": 4}, "index_head_dim=4 must be >= qk_rope_head_dim=8"),
    ],
)
def test_bad_indexer_config_is_one_line_naming_file_and_field(tmp_path, changes, message):
    path = init_tiny(tmp_path / "bad", tokenizer="bpe", arch="deepseek_v32", shards=1)
    edit_config(path, **changes)
    with pytest.raises(CheckpointError) as err:
        LLM(path)
    assert message in str(err.value)
    assert "config.json" in str(err.value)
    assert "\n" not in str(err.value)


def test_index_tensor_of_the_wrong_shape_names_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path = init_tiny(tmp_path / "bad", tokenizer="bpe", arch="deepseek_v32", shards=1)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.indexer.wk.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        LLM(path)
    assert name in str(err.value) and "model.safetensors" in str(err.value)


def test_fp8_checkpoint_in_deepseeks_v32_layout_loads(tmp_path, v32_prompts):
    """ue8m0 power-of-two block scales, weights_proj unquantised, an MTP layer present and
    skipped; greedy output stays close to the float32 checkpoint's (FP8 rounding)."""
    from safetensors.torch import load_file, save_file

    path = init_tiny(tmp_path / "fp8", tokenizer="bpe", arch="deepseek_v32", fp8=True, shards=1)
    raw = read_config(path)
    assert raw["quantization_config"]["scale_fmt"] == "ue8m0"
    tensors = load_file(path / "model.safetensors")
    scale = tensors["model.layers.1.self_attn.indexer.wq_b.weight_scale_inv"]
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    assert tensors["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    mtp = raw["num_hidden_layers"]
    tensors[f"model.layers.{mtp}.eh_proj.weight"] = torch.zeros(4, 8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    edit_config(path, num_nextn_predict_layers=1)
    outputs = LLM(path).generate(v32_prompts[:3], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)


def test_sparse_queries_gather_topk_entries_however_long_the_context(v32_path, monkeypatch):
    """Sparse for real: past index_topk a decode query's MLA reads index_topk cache rows (not a
    masked context); only the indexer's scoring reads the whole context."""
    from moeinfra.engine import attention, indexer

    gathered, scored = [], []
    decode = attention.decode_attention
    select = indexer.select_tokens
    fused = attention.fused_decode_attention

    def recording_decode(mla, query, store, slots, mask):
        gathered.append(tuple(slots.shape))
        return decode(mla, query, store, slots, mask)

    def recording_fused(mla, latent, store, plan):  # the dense rows through the fused kernel
        gathered.append((plan.decode_lengths.numel(), int(plan.decode_lengths.max())))
        return fused(mla, latent, store, plan)

    def recording_select(index, keys, rows, context, mask, topk):
        scored.append(context.shape[-1])
        return select(index, keys, rows, context, mask, topk)

    monkeypatch.setattr(attention, "decode_attention", recording_decode)
    monkeypatch.setattr(attention, "fused_decode_attention", recording_fused)
    monkeypatch.setattr(attention, "select_tokens", recording_select)
    arch, config, model = one_rank_model(v32_path)
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 4), 128, 4)
    step = StepCache(
        cache,
        {
            0: StepCache.slots_of(list(range(64)), 4),
            1: StepCache.slots_of(list(range(127, 63, -1)), 4),
        },
    )
    model(torch.arange(3, 203), [Segment(0, 0, 200)], step, "none")
    model(torch.arange(3, 9), [Segment(1, 0, 6)], step, "none")
    gathered.clear(), scored.clear()
    model(torch.tensor([5, 6]), [Segment(0, 200, 1), Segment(1, 6, 1)], step, "none")
    layers = config.num_layers
    # the short request attends densely over its 7 tokens, the long one to 16 of its 201
    assert sorted(gathered) == sorted([(1, 7)] * layers + [(1, TOPK)] * layers)
    assert scored == [201] * layers
