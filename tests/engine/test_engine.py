"""The engine's behaviour on one rank: KV blocks under churn, prefix sharing, sampling, stopping."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from moeinfra.engine import LLM, EngineConfig, EngineCore, SamplingParams
from moeinfra.engine import core as engine_core
from moeinfra.engine.hf_config import parse_config, read_config
from moeinfra.engine.registry import architecture
from moeinfra.engine.tiny import tiny_config
from moeinfra.engine.worker import run_steps

from .conftest import check_warm_up_leaves_no_trace

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_kv_blocks_never_leak_over_1000_random_requests_with_aborts(tiny_path):
    rng = np.random.default_rng(7)
    core = EngineCore(
        tiny_path,
        EngineConfig(block_size=4, num_kv_blocks=48, max_num_seqs=24, max_num_batched_tokens=96),
    )
    prefixes = [rng.integers(20, 1000, size=n).tolist() for n in (9, 14, 22)]
    added = finished = aborted = 0
    live: list[str] = []
    while added < 1000 or core.has_work:
        for _ in range(int(rng.integers(0, 12))):
            if added == 1000:
                break
            prompt = prefixes[rng.integers(3)][: int(rng.integers(1, 23))]
            prompt = prompt + rng.integers(20, 1000, size=int(rng.integers(0, 6))).tolist()
            params = SamplingParams(
                temperature=float(rng.choice([0.0, 0.8])),
                max_tokens=int(rng.integers(1, 7)),
                seed=int(rng.integers(1 << 30)),
                ignore_eos=True,
            )
            core.add_request(f"r{added}", prompt, params)
            live.append(f"r{added}")
            added += 1
        if live and rng.random() < 0.3:
            victim = live[int(rng.integers(len(live)))]
            if core.abort(victim) is not None:
                aborted += 1
        for out in core.step():
            if out.finished:
                finished += 1
                live.remove(out.request_id)
        core.blocks.check()
    assert finished + aborted == 1000
    assert aborted > 20 and core.scheduler.num_preemptions > 0
    assert core.blocks.num_used_blocks == 0
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
    assert core.blocks.hit_tokens > 0
    assert not core.requests


def test_prefix_sharing_returns_the_same_tokens_as_no_sharing(tiny_path, prompt_ids):
    shared = LLM(tiny_path, block_size=4)
    plain = LLM(tiny_path, block_size=4, enable_prefix_caching=False)
    # twice: the second round finds every full block of its prompt cached
    first = shared.generate(prompt_ids, GREEDY, use_tqdm=False)
    again = shared.generate(prompt_ids, GREEDY, use_tqdm=False)
    base = plain.generate(prompt_ids, GREEDY, use_tqdm=False)
    tokens = [[o.outputs[0].token_ids for o in run] for run in (first, again, base)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert sum(o.num_cached_tokens for o in again) > sum(o.num_cached_tokens for o in first)
    for o, ids in zip(again, prompt_ids, strict=True):
        assert o.num_cached_tokens == 4 * ((len(ids) - 1) // 4)  # all full blocks but the last
    assert all(o.num_cached_tokens == 0 for o in base)


def test_seeded_sampling_is_reproducible_per_request_whatever_the_batch(tiny_path, prompt_ids):
    llm = LLM(tiny_path)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=1234)
    alone = llm.generate([prompt_ids[4]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=10)] * 3 + [seeded]
    batch = llm.generate(prompt_ids[:3] + [prompt_ids[4]], others, use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=99)
    assert (
        llm.generate([prompt_ids[4]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    )


def test_cpu_logits_sampled_in_parts_give_the_same_tokens(tiny_path, prompt_ids, monkeypatch):
    """A CPU step samples its rows in parts of at most ``LOGITS_PART_BYTES`` of logits (two rows
    here): greedy and seeded rows draw what one part would."""
    llm = LLM(tiny_path, device="cpu", enable_prefix_caching=False)
    params = [GREEDY, SamplingParams(temperature=1.0, top_k=50, max_tokens=8, seed=7)]
    params = [params[i % 2] for i in range(len(prompt_ids))]
    whole = llm.generate(prompt_ids, params, use_tqdm=False)
    vocab = llm._core.model_config.vocab_size
    monkeypatch.setattr(engine_core, "LOGITS_PART_BYTES", 2 * 4 * vocab)
    parts = []
    sample_part = EngineCore._sample_part
    monkeypatch.setattr(
        EngineCore,
        "_sample_part",
        lambda self, hidden, sampling: (
            parts.append(len(sampling)) or sample_part(self, hidden, sampling)
        ),
    )
    split = llm.generate(prompt_ids, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in whole]
    assert max(parts) == 2 and len(parts) > 8


def test_stop_strings_stop_tokens_and_max_tokens(tiny_path, prompt_ids):
    llm = LLM(tiny_path)
    free = llm.generate([prompt_ids[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = llm.generate(
        [prompt_ids[1]], SamplingParams(temperature=0, max_tokens=8, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    token = free.token_ids[3]
    by_token = llm.generate(
        [prompt_ids[1]],
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[token]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_token.token_ids == free.token_ids[: free.token_ids.index(token) + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back(tiny_path, prompt_ids, tmp_path):
    first = LLM(tiny_path).generate([prompt_ids[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    eos = first.token_ids[2]
    path = tmp_path / "eos"
    shutil.copytree(tiny_path, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    llm = LLM(path)
    stops = llm.generate(
        [prompt_ids[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0].outputs[0]
    assert stops.token_ids == first.token_ids[: first.token_ids.index(eos) + 1]
    assert stops.finish_reason == "stop"
    ignored = llm.generate([prompt_ids[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == first.token_ids
    held = llm.generate(
        [prompt_ids[0]],
        SamplingParams(temperature=0, max_tokens=8, min_tokens=6),
        use_tqdm=False,
    )[0].outputs[0]
    assert eos not in held.token_ids[:6]


def test_abort_frees_the_request_and_its_blocks(tiny_path, prompt_ids):
    core = EngineCore(tiny_path, EngineConfig(block_size=4))
    core.add_request("a", prompt_ids[1], GREEDY)
    core.add_request("b", prompt_ids[4], GREEDY)
    core.step()
    used = core.blocks.num_used_blocks
    out = core.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert core.blocks.num_used_blocks < used
    assert core.abort("a") is None
    outputs = [o for step in run_steps(core) for o in step]
    assert [o.request_id for o in outputs if o.finished] == ["b"]
    assert core.blocks.num_used_blocks == 0


def test_prompt_that_cannot_fit_the_cache_finishes_with_length(tiny_path):
    core = EngineCore(tiny_path, EngineConfig(block_size=4, num_kv_blocks=3))
    core.add_request("big", list(range(20, 40)), GREEDY)
    out = [o for step in run_steps(core) for o in step]
    assert out[-1].finished and out[-1].finish_reason == "length" and not out[-1].new_token_ids


def test_kv_cache_bytes_per_token_equal_the_mla_formula(tiny_path):
    # DeepSeek-V3: (kv_lora_rank 512 + qk_rope_head_dim 64) values x 61 layers x 2 bytes (bf16)
    raw = tiny_config(129280) | {
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1536,
        "num_attention_heads": 128,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
    }
    config = parse_config(raw)
    layout = architecture("deepseek_v3").kv_layout(config, torch.bfloat16, 64)
    assert layout.bytes_per_token == (512 + 64) * 61 * 2 == 70_272
    # and the engine's own cache holds exactly that per slot
    core = EngineCore(tiny_path, EngineConfig(block_size=8, num_kv_blocks=10))
    c = parse_config(read_config(tiny_path)).block
    per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * 3 * 4  # 3 layers, float32
    assert core.cache.layout.bytes_per_token == per_token
    assert core.cache.nbytes == per_token * 8 * 10


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="overlap='sometimes' is not allowed"):
        EngineConfig(overlap="sometimes")
    with pytest.raises(ValueError, match="dtype='int8' is not allowed"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="eplb_interval=0 must be >= 1"):
        EngineConfig(eplb_interval=0)


def test_redundant_slots_must_divide_over_ranks(tiny_path):
    class TwoRanks:  # what the placement step reads of a 2-rank communicator
        rank, world_size, distributed, group = 0, 2, False, None

    with pytest.raises(ValueError, match=r"16 experts \+ redundant must be a multiple of ranks=2"):
        EngineCore(tiny_path, EngineConfig(redundant_experts=1), comm=TwoRanks())


@pytest.mark.timeout(90)
def test_a_spawned_unit_whose_rank_fails_names_the_rank_and_its_error(tiny_path):
    import multiprocessing

    with pytest.raises(RuntimeError, match=r"(?s)engine: rank \d of 2 failed.*16 experts \+ re"):
        LLM(tiny_path, ranks=2, redundant_experts=1, timeout_s=60)
    assert not multiprocessing.active_children()


def _stream_and_abort(llm, prompt_ids):
    """Stream every prompt; abort request 0 after its first token. Returns (deltas, aborted id)."""
    deltas: dict[int, list] = {}
    aborted = None
    for index, delta in llm.stream(prompt_ids, GREEDY):
        deltas.setdefault(index, []).append(delta)
        if index == 0 and aborted is None and delta.new_token_ids:
            aborted = delta.request_id
            llm.abort(aborted)
    return deltas, aborted


def test_stream_deltas_add_up_to_generate_and_abort_stops_one_request(tiny_path, prompt_ids):
    llm = LLM(tiny_path)
    whole = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    deltas, aborted = _stream_and_abort(llm, prompt_ids)
    assert aborted is not None
    assert deltas[0][-1].finish_reason == "abort"
    assert sum(len(d.new_token_ids) for d in deltas[0]) < GREEDY.max_tokens
    for i, out in enumerate(whole[1:], start=1):
        assert [t for d in deltas[i] for t in d.new_token_ids] == out.outputs[0].token_ids
        assert "".join(d.new_text for d in deltas[i]) == out.outputs[0].text
        assert [d.finished for d in deltas[i]].count(True) == 1 and deltas[i][-1].finished
    assert llm._core.blocks.num_used_blocks == 0


@pytest.mark.timeout(120)
def test_spawned_unit_streams_aborts_and_rebalances_on_request(tiny_path, prompt_ids, reference):
    with LLM(tiny_path, ranks=2, redundant_experts=2, timeout_s=90) as llm:
        deltas, _ = _stream_and_abort(llm, prompt_ids)
        assert deltas[0][-1].finish_reason == "abort"
        for i in range(1, len(prompt_ids)):
            assert [t for d in deltas[i] for t in d.new_token_ids] == reference[i][:8]
        llm.rebalance()  # applied by every rank before its next step
        again = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
        # one request: the other rank has nothing, yet joins every dispatch and combine
        alone = llm.generate([prompt_ids[3]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [r[:8] for r in reference]
    assert alone[0].outputs[0].token_ids == reference[3][:8]


def test_a_stream_left_early_aborts_its_requests_and_does_not_leak_into_the_next_call(
    tiny_path, prompt_ids, reference
):
    llm = LLM(tiny_path)
    stream = llm.stream(prompt_ids, GREEDY)
    next(stream)
    stream.close()  # the caller stops reading
    assert not llm._core.requests and llm._core.blocks.num_used_blocks == 0
    outputs = llm.generate(prompt_ids[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [r[:8] for r in reference[:2]]


def test_a_warm_up_leaves_no_trace(tiny_path, prompt_ids, reference):
    check_warm_up_leaves_no_trace(tiny_path, prompt_ids, reference, block_size=4)
