"""Speculative decoding with DeepSeek's MTP layer: the layer against a ``transformers`` decoder layer
holding its weights; greedy output with 1-3 drafts per step equal to ``transformers``' greedy output
(1 and 2 ranks, chunked prefill, prefix sharing, preemption), drafts accepted and rolled back, and
rejection sampling that keeps the target distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine import core as engine_core
from moeinfra.engine.core import EngineCore
from moeinfra.engine.drafting import MtpDrafter
from moeinfra.engine.kv_cache import PagedKVCache, StepCache
from moeinfra.engine.speculative import verify
from moeinfra.engine.tiny import init_tiny
from moeinfra.errors import CheckpointError, InputError
from moeinfra.moe.mla import Segment

from .conftest import MAX_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    """The session's tiny checkpoint plus one MTP layer (drawn from its own seed, so every other
    weight is the tiny checkpoint's and transformers' greedy reference holds)."""
    config = {"num_nextn_predict_layers": 1}
    return init_tiny(tmp_path_factory.mktemp("ckpt") / "mtp", tokenizer="bpe", config=config)


def _weights(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_the_mtp_layer_adds_weights_and_changes_none(mtp_path, tiny_path):
    ours, tiny = _weights(mtp_path), _weights(tiny_path)
    extra = sorted(set(ours) - set(tiny))
    assert set(tiny) <= set(ours)
    assert all(torch.equal(ours[name], tiny[name]) for name in tiny)
    layer = json.loads((mtp_path / "config.json").read_text())["num_hidden_layers"]
    assert all(name.startswith(f"model.layers.{layer}.") for name in extra)
    for part in (
        "embed_tokens",
        "enorm",
        "hnorm",
        "eh_proj",
        "shared_head.norm",
        "shared_head.head",
    ):
        assert f"model.layers.{layer}.{part}.weight" in extra
    assert f"model.layers.{layer}.mlp.experts.0.gate_proj.weight" in extra


def test_mtp_logits_equal_a_transformers_layer_holding_its_weights(mtp_path, tmp_path):
    """``head(norm(block(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))))`` with the embedding zeroed
    at position 0, the block attending over the paged cache: against transformers' DeepseekV3
    decoder layer (its final norm and LM head set to the MTP's) fed the same ``eh_proj`` output."""
    import transformers

    llm = LLM(mtp_path, speculative_config=_spec(1))
    core = llm._core
    ids = [(7 * i) % 1000 + 3 for i in range(30)]
    cache = PagedKVCache(core.cache.layout, 16, 4)
    step = StepCache(cache, {0: StepCache.slots_of(list(range(15, -1, -1)), 4)})
    hidden = core.model(torch.tensor(ids[:-1]), [Segment(0, 0, 29)], step, "none")
    mtp_cache = step.layer(core.cache.layout.num_layers - 1)
    # a prefill chunk, then two single positions reading it from the cache
    parts = [core.mtp(hidden[:27], torch.tensor(ids[1:28]), [Segment(0, 0, 27)], mtp_cache)]
    for i in (27, 28):
        parts.append(
            core.mtp(hidden[i : i + 1], torch.tensor([ids[i + 1]]), [Segment(0, i, 1)], mtp_cache)
        )
    ours = core.mtp.logits(torch.cat(parts))

    raw = json.loads((mtp_path / "config.json").read_text())
    layer, w = raw["num_hidden_layers"], _weights(mtp_path)
    prefix = f"model.layers.{layer}."
    ref_weights = {
        "model.layers.0." + name[len(prefix) :]: t
        for name, t in w.items()
        if name.startswith(prefix)
        and not name[len(prefix) :].startswith(
            ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
        )
    }
    ref_weights["model.norm.weight"] = w[prefix + "shared_head.norm.weight"]
    ref_weights["lm_head.weight"] = w[prefix + "shared_head.head.weight"]
    ref_weights["model.embed_tokens.weight"] = w[prefix + "embed_tokens.weight"]
    folder = tmp_path / "mtp-as-a-layer"
    folder.mkdir()
    config = raw | {
        "num_hidden_layers": 1,
        "first_k_dense_replace": 0,
        "num_nextn_predict_layers": 0,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file(ref_weights, folder / "model.safetensors")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def rms(x, weight):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, raw["rms_norm_eps"])

    embedded = w[prefix + "embed_tokens.weight"][torch.tensor(ids[1:])]
    embedded[0] = 0
    joined = torch.cat(
        [rms(embedded, w[prefix + "enorm.weight"]), rms(hidden, w[prefix + "hnorm.weight"])], -1
    )
    with torch.no_grad():
        expected = ref(inputs_embeds=(joined @ w[prefix + "eh_proj.weight"].T)[None]).logits[0]
    assert (ours - expected).abs().max() < 1e-4
    assert expected.abs().max() > 5


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 24, "max_num_seqs": 8},
    ],
    ids=["plain", "chunked-prefix-preempt"],
)
def test_greedy_with_drafts_equals_transformers(mtp_path, prompt_ids, reference, k, options):
    llm = LLM(mtp_path, speculative_config=_spec(k), **options)
    outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    core = llm._core
    assert core.spec_stats.num_draft_tokens > 0
    assert core.blocks.num_used_blocks == 0
    assert sum(o.num_draft_tokens for o in outputs) == core.spec_stats.num_draft_tokens
    if "num_kv_blocks" in options:
        assert core.scheduler.num_preemptions > 0
        assert any(o.num_cached_tokens > 0 for o in outputs)


def _oracle_drafts(monkeypatch, continuations: dict[tuple[int, ...], list[int]], wrong_at: int):
    """Make the MTP layer's drafts the reference continuation (the draft at position ``wrong_at``
    off by one token), so drafts are accepted up to there and rejected after."""
    draft = MtpDrafter.draft

    def oracle(self, *args):
        draft(self, *args)
        for seq in self.core.requests.values():
            if seq.drafts:
                future = continuations[tuple(seq.prompt_ids)][len(seq.output_ids) :]
                proposed = future[: len(seq.drafts)]
                if len(proposed) > wrong_at:
                    proposed[wrong_at] += 1
                seq.drafts = proposed or seq.drafts

    monkeypatch.setattr(MtpDrafter, "draft", oracle)


def test_accepted_drafts_advance_several_tokens_a_step(
    mtp_path, prompt_ids, reference, monkeypatch
):
    continuations = {tuple(p): r for p, r in zip(prompt_ids, reference, strict=True)}
    _oracle_drafts(monkeypatch, continuations, wrong_at=2)
    llm = LLM(mtp_path, speculative_config=_spec(3), block_size=4)
    outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm._core.spec_stats
    # the first two drafts are right, the third wrong: none accepted at position 3; near
    # max_tokens fewer drafts are made (only what the request may still emit)
    assert stats.per_position[0] >= stats.per_position[1] > stats.num_drafts // 2
    assert stats.per_position[2] == 0
    assert stats.num_accepted_tokens == stats.per_position.sum()
    assert all(o.num_accepted_tokens > 0 for o in outputs)
    decode_steps = [s for s in llm._core.stats if s.decode_tokens and not s.prefill_tokens]
    assert len(decode_steps) < MAX_TOKENS  # fewer steps than tokens


@pytest.mark.timeout(240)
def test_two_ranks_greedy_with_drafts_equals_transformers(mtp_path, prompt_ids, reference):
    options = {"redundant_experts": 2, "max_num_batched_tokens": 32, "overlap": "auto"}
    with LLM(mtp_path, ranks=2, timeout_s=180, speculative_config=_spec(2), **options) as llm:
        outputs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert sum(o.num_draft_tokens for o in outputs) > 0


def test_rejection_sampling_keeps_the_target_distribution():
    """The first token verify emits follows p_0 whatever the draft; seeded draws over many
    steps, a 6-token vocabulary, total-variation distance within sampling noise."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 3.0, 0.0, 1.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.8, seed=7)
    target = torch.softmax(logits[0] / 0.8, dim=-1).numpy()
    draws = 20_000
    for draft in (0, 4):  # a likely and an unlikely draft
        gen = torch.Generator().manual_seed(0)
        first = [verify(logits, [draft], params, gen, step)[0] for step in range(draws)]
        seen = np.bincount(first, minlength=6) / draws
        assert 0.5 * np.abs(seen - target).sum() < 0.015
    # all accepted: the bonus follows p_1
    gen = torch.Generator().manual_seed(0)
    bonus = [t[1] for s in range(draws) if len(t := verify(logits, [0], params, gen, s)) == 2]
    seen = np.bincount(bonus, minlength=6) / len(bonus)
    assert 0.5 * np.abs(seen - torch.softmax(logits[1] / 0.8, -1).numpy()).sum() < 0.02


def test_seeded_sampling_with_drafts_is_reproducible(mtp_path, prompt_ids):
    params = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True
    )
    runs = [
        [
            o.outputs[0].token_ids
            for o in LLM(mtp_path, speculative_config=_spec(2)).generate(
                prompt_ids[:4], params, use_tqdm=False
            )
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert all(len(t) == MAX_TOKENS for t in runs[0])


@pytest.mark.timeout(240)
def test_cpu_logits_in_parts_with_drafts_give_the_same_tokens(mtp_path, prompt_ids, monkeypatch):
    """Logits sampled in parts of two rows on the CPU: a request verifying three drafts (four
    rows) gets a part of its own, and greedy and seeded requests emit what one part would."""
    seeded = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True
    )
    params = [GREEDY, seeded] * 2

    def run() -> list[list[int]]:
        llm = LLM(mtp_path, device="cpu", speculative_config=_spec(3))
        outputs = llm.generate(prompt_ids[:4], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    whole = run()
    vocab = json.loads((mtp_path / "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(engine_core, "LOGITS_PART_BYTES", 2 * 4 * vocab)
    parts = []
    sample_part = EngineCore._sample_part

    def recording(self, hidden, sampling):
        parts.append([len(c.drafts) + 1 for c, _ in sampling])
        return sample_part(self, hidden, sampling)

    monkeypatch.setattr(EngineCore, "_sample_part", recording)
    assert run() == whole
    assert [4] in parts and all(sum(rows) <= 2 or len(rows) == 1 for rows in parts)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"method": "mtp", "num_speculative_tokens": 0},
            "num_speculative_tokens=0 must be an integer in 1..8",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 9},
            "num_speculative_tokens=9 must be an integer in 1..8",
        ),
        (
            {"method": "eagle", "num_speculative_tokens": 1},
            "speculative_config.method='eagle' is not supported",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 1, "model": "x"},
            "speculative_config.model is not supported",
        ),
        ("mtp", "speculative_config='mtp' must be a dict"),
    ],
)
def test_bad_speculative_config_is_one_line(mtp_path, config, message):
    with pytest.raises(InputError) as err:
        LLM(mtp_path, speculative_config=config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_checkpoint_without_an_mtp_layer_cannot_draft(tiny_path):
    with pytest.raises(CheckpointError) as err:
        LLM(tiny_path, speculative_config=_spec(1))
    assert "num_nextn_predict_layers=0" in str(err.value)
    assert "config.json" in str(err.value)


@pytest.mark.parametrize(
    "kind, options",
    [
        ("deepseek_v32", {"arch": "deepseek_v32"}),  # the MTP layer has its own indexer
        ("fp8", {"fp8": True}),  # its projections in FP8 blocks; eh_proj, embedding, head not
    ],
)
def test_other_layouts_draft_without_changing_greedy_output(tmp_path, prompt_ids, kind, options):
    config = {"num_nextn_predict_layers": 1}
    path = init_tiny(tmp_path / kind, tokenizer="bpe", config=config, shards=1, **options)
    plain = LLM(path).generate(prompt_ids, GREEDY, use_tqdm=False)
    llm = LLM(path, speculative_config=_spec(2))
    drafted = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm._core.spec_stats.num_draft_tokens > 0
    if kind == "fp8":
        layer = json.loads((path / "config.json").read_text())["num_hidden_layers"]
        stored = load_file(path / "model.safetensors")
        assert (
            stored[f"model.layers.{layer}.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
        )
        assert stored[f"model.layers.{layer}.eh_proj.weight"].dtype == torch.float32


def test_prefill_here_drafting_decode_there_equals_one_engine(mtp_path, prompt_ids, reference):
    """A drafting prefill unit hands off the prompt's KV with the MTP layer's rows and its first
    drafts; the decode unit verifies them in its first step and goes on drafting."""
    from moeinfra.engine.core import EngineConfig
    from moeinfra.engine.sequence import Preloaded

    config = EngineConfig(num_kv_blocks=64, block_size=4, num_speculative_tokens=2)
    prefill, decode = EngineCore(mtp_path, config), EngineCore(mtp_path, config)
    for i, ids in enumerate(prompt_ids):
        prefill.add_request(f"r{i}", ids, GREEDY, handoff="decode")
    tokens: dict[str, list[int]] = {}
    while prefill.has_work:
        for out in prefill.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    layers = prefill.cache.layout.num_layers
    for h in prefill.handoffs:
        assert h.kv.shape[0] == layers == prefill.model_config.num_layers + 1
        assert len(h.drafts) == 2
        decode.add_request(
            h.request_id,
            h.prompt_ids,
            h.params,
            output_ids=h.output_ids,
            preloaded=Preloaded(0, h.kv),
            drafts=h.drafts,
        )
    first = decode.step()
    assert decode.stats[-1].decode_tokens == 3 * len(prompt_ids)  # the token and its two drafts
    for out in first:
        tokens[out.request_id].extend(out.new_token_ids)
    while decode.has_work:
        for out in decode.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert [tokens[f"r{i}"] for i in range(len(prompt_ids))] == reference
