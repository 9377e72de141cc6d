"""DeepSeek-V4 (sliding-window + compressed attention, mHC, hash routing) against
``transformers``' DeepseekV4ForCausalLM on a tiny checkpoint with every layer kind, prompts longer
than the window (8) and several compression windows (4, 16), an indexer top-k (4) below the
compressed entries of most contexts and a SwiGLU clamp the activations reach: logits within 1e-4,
greedy generation token for token on 1 and 2 ranks with chunked prefill, prefix sharing and
preemption — and checks that the indexer's choice and the clamp change the reference's output."""

from __future__ import annotations

import pytest
import torch

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine.hf_config import read_config
from moeinfra.engine.kv_cache import PagedKVCache, StepCache
from moeinfra.engine.tiny import init_tiny
from moeinfra.errors import CheckpointError
from moeinfra.moe.mla import Segment

from .conftest import (
    PROMPTS,
    check_greedy,
    check_warm_up_leaves_no_trace,
    edit_config,
    hf_greedy,
    one_rank_model,
)

MAX_TOKENS = 16
# longer than the window and several compression windows; pairs share a 2-block prefix
V4_PROMPTS = [
    " ".join(PROMPTS[i : i + 4]) + suffix
    for i in range(0, len(PROMPTS), 2)
    for suffix in (" one", " and then another")
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    return init_tiny(tmp_path_factory.mktemp("ckpt") / "v4", tokenizer="bpe", arch="deepseek_v4")


@pytest.fixture(scope="module")
def hf_v4(v4_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(v4_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def v4_prompts(v4_path):
    from moeinfra.engine.tokenizer import Tokenizer

    tok = Tokenizer(v4_path)
    return [tok.encode(p) for p in V4_PROMPTS]


@pytest.fixture(scope="module")
def v4_reference(hf_v4, v4_prompts):
    return hf_greedy(hf_v4, v4_prompts, MAX_TOKENS)


def test_prompts_exercise_window_compression_and_sparse_choice(v4_path, v4_prompts):
    raw = read_config(v4_path)
    csa, hca = raw["compress_rates"].values()
    lengths = [len(ids) for ids in v4_prompts]
    assert min(lengths) > raw["sliding_window"]
    assert sum(n > 2 * hca for n in lengths) >= len(lengths) // 2
    # most contexts have more compressed CSA entries than the indexer keeps
    assert sum((n + MAX_TOKENS) // csa > raw["index_topk"] for n in lengths) >= 0.8 * len(lengths)


def test_logits_match_transformers_over_chunks_and_decode(v4_path, hf_v4):
    arch, config, model = one_rank_model(v4_path)
    ids = [(7 * i) % 1000 + 3 for i in range(70)]
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 16), 8, 16)
    step = StepCache(cache, {0: StepCache.slots_of([5, 2, 7, 0, 3], 16)})
    parts = [model(torch.tensor(ids[:5]), [Segment(0, 0, 5)], step, "none")]
    parts.append(model(torch.tensor(ids[5:50]), [Segment(0, 5, 45)], step, "none"))
    for i in range(50, 70):
        parts.append(model(torch.tensor([ids[i]]), [Segment(0, i, 1)], step, "none"))
    ours = model.logits(torch.cat(parts))
    with torch.no_grad():
        ref = hf_v4(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() < LOGIT_TOL
    assert ref.abs().max() > 5


def test_a_sequence_resumes_at_a_block_boundary_from_shared_blocks(v4_path, hf_v4):
    """What a prefix hit, a preemption or a hand-off does: a new sequence reads the blocks another
    computed and goes on from a block boundary (position 32), rebuilding what it holds outside the
    cache — its window keys from the block's checkpoint, CSA's last window from its tail — logits
    equal transformers' past the boundary; resuming inside a block is refused."""
    arch, config, model = one_rank_model(v4_path)
    ids = [(5 * i) % 1000 + 7 for i in range(60)]
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 16), 8, 16)
    table = StepCache.slots_of([3, 1, 6, 0], 16)
    step = StepCache(cache, {0: table, 1: table})
    model(torch.tensor(ids[:40]), [Segment(0, 0, 40)], step, "none")
    model.release(0)
    ours = model.logits(model(torch.tensor(ids[32:60]), [Segment(1, 32, 28)], step, "none"))
    with torch.no_grad():
        ref = hf_v4(torch.tensor([ids])).logits[0, 32:]
    assert (ours - ref).abs().max() < LOGIT_TOL
    with pytest.raises(RuntimeError, match=r"every 16 tokens\), not at position 40"):
        model(torch.tensor(ids[40:41]), [Segment(2, 40, 1)], StepCache(cache, {2: table}), "none")


def test_batched_segments_match_one_at_a_time(v4_path):
    """Two sequences in one step (a prefill chunk beside a decode token) read only their own
    cache slots."""
    arch, config, model = one_rank_model(v4_path)
    a, b = list(range(3, 43)), list(range(500, 540))
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 16), 8, 16)
    slots = {0: StepCache.slots_of([0, 1, 2], 16), 1: StepCache.slots_of([7, 6, 5], 16)}
    step = StepCache(cache, slots)
    model(torch.tensor(a[:39]), [Segment(0, 0, 39)], step, "none")
    model(torch.tensor(b[:20]), [Segment(1, 0, 20)], step, "none")
    both = model(
        torch.tensor([a[39], *b[20:40]]), [Segment(0, 39, 1), Segment(1, 20, 20)], step, "none"
    )
    alone = PagedKVCache(arch.kv_layout(config, torch.float32, 16), 8, 16)
    ref = model(torch.tensor(b), [Segment(1, 0, 40)], StepCache(alone, slots), "none")
    assert (model.logits(both[1:]) - model.logits(ref[20:])).abs().max() < LOGIT_TOL


@pytest.mark.parametrize("lengths", [(5, 12, 39, 70), (12, 39, 70)])
def test_decode_tokens_of_several_requests_match_each_alone(v4_path, lengths):
    """Decode rows go through attention as one batch: requests still filling their window
    (left-padded), completing compression windows, past index_topk entries (each query's own
    top-k) and reaching a block's end (its checkpoint and tail written: the request resumes from
    them) — the logits each would get alone."""
    arch, config, model = one_rank_model(v4_path)
    layout = arch.kv_layout(config, torch.float32, 16)
    slots = {i: StepCache.slots_of(list(range(6 * i, 6 * i + 6)), 16) for i in range(len(lengths))}
    tokens = {i: [(7 * i + 3 * t) % 400 + 3 for t in range(n + 5)] for i, n in enumerate(lengths)}
    shared = StepCache(PagedKVCache(layout, 6 * len(lengths), 16), slots)
    for i, n in enumerate(lengths):
        model(torch.tensor(tokens[i][:n]), [Segment(i, 0, n)], shared, "none")
    together = []
    for t in range(4):
        step = [Segment(i, n + t, 1) for i, n in enumerate(lengths)]
        ids = torch.tensor([tokens[i][n + t] for i, n in enumerate(lengths)])
        together.append(model.logits(model(ids, step, shared, "none")))
    at_block_end = lengths.index(12)  # 16 tokens now: resumes from what the batch wrote
    model.release(at_block_end)
    step = [Segment(at_block_end, 16, 1)]
    resumed = model.logits(model(torch.tensor([tokens[at_block_end][16]]), step, shared, "none"))
    for i, n in enumerate(lengths):
        alone = StepCache(PagedKVCache(layout, 6 * len(lengths), 16), slots)
        model.release(i)
        out = model(torch.tensor(tokens[i][: n + 5]), [Segment(i, 0, n + 5)], alone, "none")
        expected = model.logits(out[n:])
        got = torch.stack([logits[i] for logits in together])
        if i == at_block_end:
            got = torch.cat([got, resumed])
        else:
            expected = expected[:-1]
        assert (got - expected).abs().max() < LOGIT_TOL, (n, (got - expected).abs().max())


def _set_reference(hf_model, topk=None, limit=None):
    for layer in hf_model.model.layers:
        compressor = layer.self_attn.compressor
        if topk is not None and hasattr(compressor, "indexer"):
            compressor.indexer.index_topk = topk
        if limit is not None:
            layer.mlp.experts.limit = layer.mlp.shared_experts.limit = limit


def test_the_indexer_choice_and_the_swiglu_clamp_change_the_answer(
    hf_v4, v4_path, v4_prompts, v4_reference
):
    raw = read_config(v4_path)
    try:
        _set_reference(hf_v4, topk=10**6)
        all_entries = hf_greedy(hf_v4, v4_prompts, MAX_TOKENS)
        _set_reference(hf_v4, topk=raw["index_topk"], limit=1e9)
        unclamped = hf_greedy(hf_v4, v4_prompts, MAX_TOKENS)
    finally:
        _set_reference(hf_v4, topk=raw["index_topk"], limit=raw["swiglu_limit"])
    assert all_entries != v4_reference
    assert unclamped != v4_reference


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 24, "block_size": 16, "num_kv_blocks": 12, "max_num_seqs": 8},
    ],
    ids=["plain", "chunked-prefix-preempt"],
)
def test_one_rank_greedy_equals_transformers(v4_path, v4_prompts, v4_reference, options):
    llm = LLM(v4_path, **options)
    outputs = llm.generate(v4_prompts, GREEDY, use_tqdm=False)
    check_greedy(outputs, v4_reference, v4_prompts)
    if "num_kv_blocks" in options:
        assert llm._core.scheduler.num_preemptions > 0
        assert any(o.num_cached_tokens > 0 for o in outputs)


@pytest.mark.timeout(300)
def test_a_warm_up_leaves_no_trace(v4_path, v4_prompts, v4_reference):
    """The warm-up's prompt crosses the sliding window and compression windows; what it held
    outside the cache is released with its blocks."""
    check_warm_up_leaves_no_trace(v4_path, v4_prompts, v4_reference, max_num_batched_tokens=100)


def test_prompts_sharing_a_block_then_parting_resume_from_their_own_blocks(
    v4_path, hf_v4, v4_prompts
):
    """Prompts that share their first block and part in the second, too little memory for all of
    them (preemption) and prefix caching: a preempted request resumes from its own cached blocks,
    whose window checkpoint only it wrote (a checkpoint spread over blocks another prompt shares
    would be overwritten by that prompt's)."""
    from moeinfra.engine.tokenizer import Tokenizer

    tok = Tokenizer(v4_path)
    text = "Prefill and decode are disaggregated: a prefill unit computes the KV cache and hands it"
    prompts = [tok.encode(text + tail) for tail in (" over", " to a decode unit", " back")]
    assert len({tuple(p[:16]) for p in prompts}) == 1 and min(map(len, prompts)) > 16
    llm = LLM(v4_path, block_size=16, num_kv_blocks=8, max_num_seqs=8)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_greedy(outputs, hf_greedy(hf_v4, prompts, MAX_TOKENS), prompts)
    assert llm._core.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outputs)


def test_two_ranks_greedy_equals_transformers(v4_path, v4_prompts, v4_reference):
    options = {"redundant_experts": 2, "max_num_batched_tokens": 32, "block_size": 16}
    with LLM(v4_path, ranks=2, timeout_s=240, **options) as llm:
        outputs = llm.generate(v4_prompts, GREEDY, use_tqdm=False)
    check_greedy(outputs, v4_reference, v4_prompts)


def test_live_rebalancing_moves_experts_and_keeps_the_answer(v4_path, v4_prompts, v4_reference):
    """Live EPLB on V4: every 2 steps the redundant slots are re-placed from the last steps' loads
    (the hash-routed layer's fixed experts counted like the others); greedy output unchanged."""
    llm = LLM(v4_path, redundant_experts=4, eplb_interval=2, eplb_window=3)
    before = llm._core.plan.phy2log.copy()
    outputs = llm.generate(v4_prompts, GREEDY, use_tqdm=False)
    check_greedy(outputs, v4_reference, v4_prompts)
    assert llm._core.rebalances >= 3
    assert (llm._core.plan.phy2log != before).any()


def test_deepseeks_own_tensor_names_load_the_same_model(tmp_path, v4_path):
    """DeepSeek's release names (``layers.N.attn.*``, ``embed.weight``, ``hc_head_fn``) read as
    transformers' (``model.layers.N.attn.*``, ``model.embed_tokens.weight``, ``model.hc_head.hc_fn``);
    the MTP layers DeepSeek ships (``mtp.*``) are present and not read."""
    import shutil

    from safetensors.torch import load_file, save_file

    native = tmp_path / "native"
    shutil.copytree(v4_path, native)
    tensors = {}
    for shard in sorted(native.glob("*.safetensors")):
        tensors |= load_file(shard)
        shard.unlink()
    (native / "model.safetensors.index.json").unlink()
    renamed = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        renamed[name.replace("hc_head.hc_", "hc_head_")] = t
    renamed["mtp.0.attn.wq_a.weight"] = torch.full((3, 5), float("nan"))
    renamed["mtp.0.hc_head_fn"] = torch.full((2, 7), float("nan"))
    save_file(renamed, native / "model.safetensors", metadata={"format": "pt"})
    ids = torch.arange(3, 40)
    outs = []
    for path in (v4_path, native):
        arch, config, model = one_rank_model(path)
        cache = PagedKVCache(arch.kv_layout(config, torch.float32, 16), 4, 16)
        step = StepCache(cache, {0: StepCache.slots_of([0, 1, 2], 16)})
        outs.append(model.logits(model(ids, [Segment(0, 0, len(ids))], step, "none")))
    assert torch.equal(outs[0], outs[1])


def test_cache_and_request_state_bytes_follow_their_formulas(v4_path):
    """Per token and layer the cache holds a share of its block's window checkpoint (the 7 window
    keys before the block's end, spread over its 16 tokens), a 1/ratio slice of its window's entry
    and index key, and a 1/block share of its block's CSA tail; a running request holds its last 7
    window keys and at most its open windows' projections (and CSA's last whole window's)."""
    from moeinfra.engine.models.deepseek_v4 import (
        checkpoint_tokens,
        state_bytes_per_request,
        tail_values,
    )

    arch, config, model = one_rank_model(v4_path)
    v4, block = config.v4, 16
    layout = arch.kv_layout(config, torch.float32, block)
    csa, hca = 4, 16
    assert checkpoint_tokens(config, block) == block
    assert tail_values(v4) == csa * 2 * (v4.head_dim + v4.index_head_dim)
    window_share = -(-(v4.sliding_window - 1) * v4.head_dim // block)
    csa_layer = (
        window_share + (v4.head_dim + v4.index_head_dim) // csa + -(-tail_values(v4) // block)
    )
    hca_layer = window_share + v4.head_dim // hca
    # layers: window only, CSA, HCA, CSA
    assert (window_share, csa_layer, hca_layer) == (14, 50, 16)
    assert layout.values_per_token == window_share + 2 * csa_layer + hca_layer == 130
    assert layout.bytes_per_token == 130 * 4
    cache = PagedKVCache(layout, num_blocks=4, block_size=block)
    assert cache.nbytes == layout.bytes_per_token * 4 * block
    # 47 tokens: HCA's open window holds 15 (ratio - 1), CSA's 3 plus its last whole window's 4
    step = StepCache(cache, {0: StepCache.slots_of([0, 1, 2], block)})
    model(torch.arange(3, 50), [Segment(0, 0, 47)], step, "none")
    held = sum(
        t.numel() * t.element_size()
        for layer in model.layers
        for t in [layer.attn.held[0].window, *layer.attn.held[0].rows]
    )
    assert held == state_bytes_per_request(config, torch.float32)
    assert (47 - 1) % hca == hca - 2 and 47 % csa == csa - 1
    model.release(0)
    assert all(not layer.attn.held for layer in model.layers)


def test_llm_picks_a_block_size_that_fits_the_architecture(v4_path):
    """What a vLLM user pointing LLM(model=...) at DeepSeek-V4 expects: no block size to choose.
    The default holds whole compression windows and four sliding windows (512 for the published
    V4-Flash and V4-Pro, whose 128-token HCA windows the engine's usual 64 would split)."""
    from moeinfra.engine.hf_config import published_config
    from moeinfra.engine.models.deepseek_v4 import default_block_size
    from moeinfra.engine.registry import architecture

    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        raw = published_config(name)
        config = architecture(raw["model_type"]).parse_config(raw, "config.json")
        assert default_block_size(config) == 512
    assert LLM(v4_path)._core.config.block_size == 64  # tiny: ratios 4 and 16, window 8
    assert LLM(v4_path, block_size=32)._core.config.block_size == 32


def test_serve_picks_the_architectures_block_size_unless_given(tmp_path):
    """``serve up`` / ``serve unit`` without ``--block-size`` use the block size LLM would."""
    import json

    from moeinfra.cli.serve_live import _engine_config
    from moeinfra.engine.hf_config import published_config
    from moeinfra.engine.registry import default_block_size

    (tmp_path / "config.json").write_text(json.dumps(published_config("deepseek-v4-flash")))
    assert default_block_size(tmp_path) == 512

    def block_size(given):
        options = (512, None, 0.9, given, 256, 2048, "auto", 0, 0, "auto", "cpu", 0)
        return _engine_config(tmp_path, *options).block_size

    assert block_size(None) == 512 and block_size(128) == 128


def test_published_v4_flash_cache_per_token(v4_path):
    """DeepSeek-V4-Flash (bf16): every layer a share of its block's window checkpoint (127 keys of
    512 over the block: 508 values with 128-token blocks, 127 with 512); its 21 CSA layers 128
    entry-slice + 32 index-key-slice + tail values more, its 20 HCA layers a 4-value entry slice."""
    from moeinfra.engine.hf_config import published_config
    from moeinfra.engine.registry import architecture

    raw = published_config("deepseek-v4-flash")
    arch = architecture(raw["model_type"])
    config = arch.parse_config(raw, "config.json")
    for block, bytes_per_token in ((128, 52_248), (512, 18_222)):
        layout = arch.kv_layout(config, torch.bfloat16, block)
        window_share = -(-127 * 512 // block)
        csa = window_share + 512 // 4 + 128 // 4 + -(-4 * 2 * (512 + 128) // block)
        hca = window_share + 512 // 128
        assert layout.values_per_token == 21 * csa + 20 * hca + 2 * window_share
        assert layout.bytes_per_token == bytes_per_token


@pytest.fixture
def bad_path(tmp_path):
    return init_tiny(tmp_path / "bad", tokenizer="bpe", arch="deepseek_v4", shards=1)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"layer_types": None, "compress_rates": None, "compress_ratios": [0, 4, 64, 4]},
            "compress_ratios value 64 is not one of [0, 4, 128]",
        ),
        ({"sliding_window": 0}, "sliding_window=0 must be an integer >= 1"),
        ({"layer_types": ["sliding_attention"] * 3}, "3 layer types for num_hidden_layers=4"),
        ({"index_topk": None}, "required key 'index_topk' is missing"),
        ({"o_groups": 3}, "o_groups=3 must divide num_attention_heads=4"),
    ],
)
def test_bad_config_is_one_line_naming_file_and_field(bad_path, changes, message):
    edit_config(bad_path, **changes)
    with pytest.raises(CheckpointError) as err:
        LLM(bad_path)
    assert message in str(err.value)
    assert "config.json" in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_hash_table_and_bad_block_size_are_one_line(bad_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(CheckpointError, match="block_size=8 must be a multiple of every"):
        LLM(bad_path, block_size=8)
    tensors = load_file(bad_path / "model.safetensors")
    del tensors["model.layers.0.ffn.gate.tid2eid"]
    save_file(tensors, bad_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        LLM(bad_path)
    assert "model.layers.0.ffn.gate.tid2eid is missing" in str(err.value)
    assert "\n" not in str(err.value)


def test_speculative_decoding_is_refused_in_one_line(v4_path):
    with pytest.raises(CheckpointError, match="num_speculative_tokens must be 0"):
        LLM(v4_path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_fp8_and_fp4_checkpoint_reads_as_transformers_reads_it(tmp_path):
    """DeepSeek-V4-Flash's layout at tiny size: FP8 projections with power-of-two (ue8m0) block
    scales, routed experts in MXFP4 (int8 pairs, a scale per 32 values); logits equal
    transformers' on the same files (its FP8 loader, dequantising), also under DeepSeek's own
    ``.scale`` names."""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    import transformers
    from safetensors.torch import load_file, save_file

    path = init_tiny(tmp_path / "fp8", tokenizer="bpe", arch="deepseek_v4", fp8=True, shards=1)
    tensors = load_file(path / "model.safetensors")
    assert tensors["model.layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert tensors["model.layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    quant = transformers.FineGrainedFP8Config(
        dequantize=True, weight_block_size=[128, 128], scale_fmt="ue8m0", expert_dtype="fp4"
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=quant
    ).eval()
    ids = torch.arange(3, 60)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    native = tmp_path / "native"
    native.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (native / f.name).write_bytes(f.read_bytes())
    renamed = {k.replace(".weight_scale_inv", ".scale"): t for k, t in tensors.items()}
    save_file(renamed, native / "model.safetensors", metadata={"format": "pt"})
    for folder in (path, native):
        arch, config, model = one_rank_model(folder)
        cache = PagedKVCache(arch.kv_layout(config, torch.float32, 16), 4, 16)
        step = StepCache(cache, {0: StepCache.slots_of([0, 1, 2, 3], 16)})
        ours = model.logits(model(ids, [Segment(0, 0, len(ids))], step, "none"))
        assert (ours - ref).abs().max() < LOGIT_TOL, folder.name


def test_fp4_tensor_without_its_scale_names_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path = init_tiny(tmp_path / "fp4", tokenizer="bpe", arch="deepseek_v4", fp8=True, shards=1)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.2.ffn.experts.3.w2.weight"
    del tensors[name + "_scale_inv"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        LLM(path)
    assert f"tensor {name} is FP4 but {name}_scale_inv is missing" in str(err.value)
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)


def test_a_decode_query_reads_only_its_chosen_entries(v4_path, monkeypatch):
    """Sparse for real: past index_topk entries a CSA decode query gathers index_topk entries'
    slices (ratio rows each), not the context's; the indexer's keys are read whole, by design."""
    from moeinfra.engine.models import deepseek_v4

    arch, config, model = one_rank_model(v4_path)
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 16), 16, 16)
    slots = {s: StepCache.slots_of(list(range(8 * s, 8 * s + 8)), 16) for s in (0, 1)}
    step = StepCache(cache, slots)
    model(torch.arange(3, 103), [Segment(0, 0, 100)], step, "none")
    model(torch.arange(5, 106), [Segment(1, 0, 101)], step, "none")
    shapes = []
    real = deepseek_v4.gather

    def recording(rows, slots):
        shapes.append(tuple(slots.shape))
        return real(rows, slots)

    monkeypatch.setattr(deepseek_v4, "gather", recording)
    model(torch.tensor([5]), [Segment(0, 100, 1)], step, "none")
    topk, csa = config.v4.index_topk, 4
    assert (1, topk, csa) in shapes  # each CSA layer: the query's top-k entries, 4 rows each
    assert (100 // csa * csa,) in shapes  # the indexer's keys: every complete window's
    shapes.clear()  # two requests' decode tokens as one batch: each its own top-k
    model(torch.tensor([5, 6]), [Segment(0, 101, 1), Segment(1, 101, 1)], step, "none")
    assert (2, topk * csa) in shapes and (2, 100 // csa * csa) in shapes
