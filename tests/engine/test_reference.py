"""The engine against Hugging Face ``transformers``' DeepseekV3ForCausalLM on the tiny checkpoint
(float32): logits within a stated tolerance, greedy generation token for token — on 1, 2 and 4 EP
ranks, with and without redundant experts, micro-batch overlap, chunked prefill, prefix sharing,
preemption, and across live expert rebalances."""

from __future__ import annotations

import pytest
import torch

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine.kv_cache import PagedKVCache, StepCache
from moeinfra.moe.launch import launch
from moeinfra.moe.mla import Segment

from .conftest import MAX_TOKENS, one_rank_model

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# float32 end to end; measured ~1e-5 on logits of magnitude ~20 (the absorbed MLA form and the
# paged gather sum in a different order than transformers' eager attention).
LOGIT_TOL = 1e-4


def test_logits_match_transformers_prefill_and_decode(tiny_path, hf_model, prompt_ids):
    arch, config, model = one_rank_model(tiny_path)
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 4), 32, 4)
    ids = prompt_ids[1]
    table = StepCache.slots_of([7, 2, 30, 5, 11, 0, 9, 1, 3, 4, 6, 8, 10, 12], 4)
    step = StepCache(cache, {0: table})
    ours = model.logits(model(torch.tensor(ids), [Segment(0, 0, len(ids))], step, "none"))
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids + [17]])).logits[0]
    assert (ours - ref[:-1]).abs().max() < LOGIT_TOL
    # one decode step reads the cached latents of every earlier position
    nxt = model.logits(model(torch.tensor([17]), [Segment(0, len(ids), 1)], step, "none"))
    assert (nxt[0] - ref[-1]).abs().max() < LOGIT_TOL
    assert ref.abs().max() > 5  # the comparison is not between near-zero logits


def test_long_prompt_chunks_attend_expanded_and_match_transformers(tiny_path, hf_model):
    """A prompt chunk past the threshold attends with per-head keys and values (the prefill path);
    its logits match transformers as the absorbed decode path's do."""
    from moeinfra.engine.attention import expanded_attention_threshold

    arch, config, model = one_rank_model(tiny_path)
    threshold = expanded_attention_threshold(model.dense[0].attn)
    ids = [(7 * i) % 1000 + 3 for i in range(150)]
    assert len(ids) > threshold > 1
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 4), 64, 4)
    step = StepCache(cache, {0: StepCache.slots_of(list(range(40)), 4)})
    # a first chunk of 40 (absorbed) then one of 110 (expanded) reading the first from the cache
    first = model(torch.tensor(ids[:40]), [Segment(0, 0, 40)], step, "none")
    rest = model(torch.tensor(ids[40:]), [Segment(0, 40, 110)], step, "none")
    ours = model.logits(torch.cat([first, rest]))
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() < LOGIT_TOL


def test_whole_prompts_of_one_step_share_projections_and_match_transformers(
    tiny_path, hf_model, monkeypatch
):
    """Whole prompts past the threshold in one step attend through one ``wkv_b`` and one ``wo``
    over all their rows (the CPU's batched prefill); a shorter prompt and a continued chunk
    beside them attend on their own. Every prompt's logits match transformers."""
    from moeinfra.engine import attention
    from moeinfra.engine.attention import expanded_attention_threshold

    batched = []
    shared = attention._fresh_chunks_attention
    monkeypatch.setattr(
        attention,
        "_fresh_chunks_attention",
        lambda mla, latent, chunks, out: (
            batched.append(len(chunks)) or shared(mla, latent, chunks, out)
        ),
    )
    arch, config, model = one_rank_model(tiny_path)
    threshold = expanded_attention_threshold(model.dense[0].attn)
    lengths = (90, 130, 20, 110)
    prompts = [
        [(k * i + 5) % 1000 + 3 for i in range(n)]
        for k, n in zip((7, 11, 13, 17), lengths, strict=True)
    ]
    assert min(lengths[:2] + lengths[3:]) > threshold > lengths[2]
    cache = PagedKVCache(arch.kv_layout(config, torch.float32, 4), 160, 4)
    step = StepCache(
        cache, {s: StepCache.slots_of(list(range(40 * s, 40 * s + 40)), 4) for s in range(4)}
    )
    # prompt 3 has its first 30 tokens cached already: its chunk reads them back
    model(torch.tensor(prompts[3][:30]), [Segment(3, 0, 30)], step, "none")
    segments = [Segment(s, 0, n) for s, n in enumerate(lengths[:3])] + [Segment(3, 30, 80)]
    ids = torch.tensor(prompts[0] + prompts[1] + prompts[2] + prompts[3][30:])
    ours = model.logits(model(ids, segments, step, "none")).split([90, 130, 20, 80])
    assert batched and all(n == 2 for n in batched)
    for prompt, mine, skip in zip(prompts, ours, (0, 0, 0, 30), strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, skip:]
        assert (mine - ref).abs().max() < LOGIT_TOL


def test_decode_attention_in_request_groups_equals_transformers(
    tiny_path, prompt_ids, reference, monkeypatch
):
    """On the CPU a large decode batch attends in groups of requests (their gathered contexts
    cache-sized); one request per group gives the same tokens."""
    from moeinfra.engine import attention

    monkeypatch.setattr(attention, "DECODE_GATHER_BYTES", 1)
    outputs = LLM(tiny_path).generate(prompt_ids, GREEDY, use_tqdm=False)
    _check(outputs, reference, prompt_ids)


def test_decode_contexts_padded_to_a_bucket_equal_transformers(
    tiny_path, prompt_ids, reference, monkeypatch
):
    """A bfloat16 cache on the CPU pads decode contexts to a multiple of 64 tokens (oneDNN builds a
    kernel per shape); padded, masked positions change no token (float32 here, so that the
    comparison is exact; 5 tokens, so that every step pads)."""
    from moeinfra.engine import attention

    monkeypatch.setattr(attention, "_decode_length_bucket", lambda step: 5)
    outputs = LLM(tiny_path).generate(prompt_ids, GREEDY, use_tqdm=False)
    _check(outputs, reference, prompt_ids)


def _check(outputs, reference, prompt_ids):
    assert [o.prompt_token_ids for o in outputs] == prompt_ids
    for o, ref in zip(outputs, reference, strict=True):
        assert o.outputs[0].token_ids == ref, o.prompt
        assert o.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "options",
    [
        {},
        # chunked prefill (16-token budget), prefix sharing in 4-token blocks, a KV pool small
        # enough that requests are preempted and recomputed
        {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 20, "max_num_seqs": 8},
        {"overlap": "prefill", "max_num_batched_tokens": 24},
        {"overlap": "decode"},
    ],
    ids=["plain", "chunked-prefix-preempt", "overlap-prefill", "overlap-decode"],
)
def test_one_rank_greedy_equals_transformers(tiny_path, prompt_ids, reference, options):
    llm = LLM(tiny_path, **options)
    outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    _check(outputs, reference, prompt_ids)
    core = llm._core
    assert core.blocks.num_used_blocks == 0
    if "num_kv_blocks" in options:
        assert core.scheduler.num_preemptions > 0
        assert any(o.num_cached_tokens > 0 for o in outputs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "ranks, options",
    [
        (2, {"overlap": "none"}),
        (2, {"overlap": "auto", "redundant_experts": 2, "max_num_batched_tokens": 32}),
        (4, {"overlap": "auto", "redundant_experts": 4, "eplb_interval": 3, "eplb_window": 4}),
    ],
    ids=["ep2", "ep2-redundant-overlap-chunked", "ep4-redundant-overlap-rebalance"],
)
def test_spawned_unit_greedy_equals_transformers(tiny_path, prompt_ids, reference, ranks, options):
    with LLM(tiny_path, ranks=ranks, timeout_s=180, **options) as llm:
        outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    _check(outputs, reference, prompt_ids)


def _torchrun_rank(path: str, prompt_ids, options):
    """One rank of a torchrun-style job: the process group exists, LLM(ranks=None) joins it."""
    import torch.distributed as dist

    llm = LLM(path, ranks=None, **options)
    before = llm._core.plan.phy2log.copy()
    # different lengths, so the ranks run out of their own requests at different steps
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(10)]
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    core = llm._core
    moved = int((core.plan.phy2log != before).sum())
    llm.shutdown()
    return {
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "rebalances": core.rebalances,
        "slots_moved": moved,
        "rank": dist.get_rank(),
        "used_blocks": core.blocks.num_used_blocks,
    }


@pytest.mark.timeout(240)
def test_torchrun_style_unit_rebalances_live_and_equals_transformers(
    tiny_path, prompt_ids, reference
):
    options = {"redundant_experts": 2, "eplb_interval": 2, "eplb_window": 3, "overlap": "auto"}
    results = launch(2, _torchrun_rank, (str(tiny_path), prompt_ids, options), timeout_s=200)
    for r in results:
        assert r["tokens"] == [ref[: 3 + i] for i, ref in enumerate(reference)]
        assert r["rebalances"] >= 3
        assert r["used_blocks"] == 0
    # the load changed the placement, so expert weights moved between ranks mid-generation
    assert any(r["slots_moved"] > 0 for r in results)
