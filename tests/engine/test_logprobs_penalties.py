"""Log-probabilities and logit processing against ``transformers`` on the tiny checkpoint (float32):
the raw log-softmax at every prompt and output position, and greedy output under each penalty, a
logit bias, allowed tokens and bad words equal to ``transformers``' own logits processors (the
OpenAI frequency/presence formula applied to its logits where it has no processor of its own);
with MTP drafts the same tokens and log-probabilities as without."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, SequenceBiasLogitsProcessor
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

from moeinfra.engine import LLM, SamplingParams
from moeinfra.engine.tiny import init_tiny

# float32 on both sides; the engine's logits match transformers' within 1e-4 (test_reference)
LOGPROB_TOL = 2e-4
PROMPT = "Prefill and decode are disaggregated: a prefill unit computes the KV cache"
NEW = 10


@pytest.fixture(scope="module")
def llm(tiny_path):
    # a small token budget: a prompt's log-probabilities are gathered over several chunks
    with LLM(tiny_path, block_size=4, num_kv_blocks=256, max_num_batched_tokens=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenizer.encode(PROMPT)


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_are_transformers_raw_log_softmax(llm, hf_model, prompt):
    # the prompt's first blocks are cached first: prompt log-probabilities still cover every token
    llm.generate([prompt[:9]], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True, repetition_penalty=1.5)  # fmt: skip
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    ref = _hf_logprobs(hf_model, prompt + tokens)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    positions = list(zip(range(len(prompt) - 1), out.prompt_logprobs[1:], strict=True))
    positions += list(zip(range(len(prompt) - 1, len(ref)), out.outputs[0].logprobs, strict=False))
    full = prompt + tokens
    for at, entry in positions:
        row = ref[at]
        assert entry.token_id == full[at + 1]
        assert abs(entry.logprob - row[full[at + 1]].item()) < LOGPROB_TOL
        chosen = row[full[at + 1]]
        assert int((row > chosen + LOGPROB_TOL).sum()) < entry.rank
        assert entry.rank <= int((row >= chosen - LOGPROB_TOL).sum())
        top = row.topk(len(entry.top_ids))
        assert entry.top_ids == top.indices.tolist()
        gaps = [abs(a - b) for a, b in zip(entry.top_logprobs, top.values.tolist(), strict=True)]
        assert max(gaps) < LOGPROB_TOL
    assert len(out.outputs[0].logprobs) == NEW


class _OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens (transformers has no
    processor for them): ``logit - frequency * count - presence * (count > 0)``."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        made = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, made, torch.ones_like(made, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _hf_greedy(hf_model, ids: list[int], **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "case",
    ["repetition", "frequency+presence", "logit_bias", "allowed", "bad_words", "min_p=1"],
)
def test_greedy_under_each_processor_equals_transformers(llm, hf_model, case):
    # a prompt whose greedy continuation each penalty changes (the tiny model's top tokens
    # rarely repeat over longer prompts)
    prompt = llm.tokenizer.encode("x")
    plain = _hf_greedy(hf_model, prompt)
    if case == "repetition":
        ours = dict(repetition_penalty=1.8)
        ref = _hf_greedy(hf_model, prompt, repetition_penalty=1.8)
    elif case == "frequency+presence":
        ours = dict(frequency_penalty=1.5, presence_penalty=0.7)
        processor = _OpenAIPenalties(len(prompt), 1.5, 0.7)
        ref = _hf_greedy(hf_model, prompt, logits_processor=LogitsProcessorList([processor]))
    elif case == "logit_bias":
        bias = {plain[1]: -100.0, 7: 30.0}
        ours = dict(logit_bias=bias)
        processor = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
        ref = _hf_greedy(hf_model, prompt, logits_processor=LogitsProcessorList([processor]))
    elif case == "allowed":
        allowed = sorted(set(plain[::2]) | {3, 99, 500})
        ours = dict(allowed_token_ids=allowed)
        processor = PrefixConstrainedLogitsProcessor(lambda _batch, _ids: allowed, 1)
        ref = _hf_greedy(hf_model, prompt, logits_processor=LogitsProcessorList([processor]))
    elif case == "bad_words":
        word = llm.tokenizer.decode([plain[2]])
        ours = dict(bad_words=[word])
        banned = [list(ids) for ids in _word_ids(llm, word)]
        ref = _hf_greedy(hf_model, prompt, bad_words_ids=banned)
    else:  # only the most likely token survives min_p = 1: sampling is greedy
        ours = dict(min_p=1.0, temperature=0.8, seed=3)
        ref = plain
    params = SamplingParams(
        max_tokens=NEW, ignore_eos=True, logprobs=0, **({"temperature": 0} | ours)
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref
    if case != "min_p=1":
        assert ref != plain  # the processor mattered for this prompt
        # the log-probabilities are the raw ones: some chosen token is not the model's top one
        raw = _hf_logprobs(hf_model, prompt + ref)[len(prompt) - 1 : -1]
        chosen = raw[torch.arange(NEW), torch.tensor(ref)]
        got = torch.tensor([e.logprob for e in out.logprobs])
        assert (got - chosen).abs().max() < LOGPROB_TOL and any(e.rank > 1 for e in out.logprobs)


def _word_ids(llm, word):
    from moeinfra.engine.logits_processing import bad_word_ids

    return bad_word_ids(llm.tokenizer, [word])


def test_a_stop_token_ends_the_request_without_its_text_unless_asked(llm, prompt):
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]  # fmt: skip
    stop = plain.token_ids[4]
    first = plain.token_ids.index(stop)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[stop],
                                include_stop_str_in_output=include)  # fmt: skip
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == plain.token_ids[: first + 1]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        shown = llm.tokenizer.decode(plain.token_ids[: first + 1 if include else first])
        assert out.text == shown


def test_bad_parameters_are_refused_in_one_line(llm, prompt):
    from moeinfra.errors import InputError

    vocab = llm.tokenizer.vocab_size
    for params, part in (
        (dict(logit_bias={vocab + 5: 1.0}), "outside the vocabulary"),
        (dict(presence_penalty=3), "presence_penalty=3 must be a number in [-2, 2]"),
        (dict(repetition_penalty=0), "repetition_penalty=0 must be a number > 0"),
        (dict(logprobs=21), "logprobs=21 must be None or an int in 0..20"),
        (dict(min_p=1.5), "min_p=1.5"),
        (dict(allowed_token_ids=[]), "allowed_token_ids=[]"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
    ):
        with pytest.raises(InputError, match=part.replace("[", r"\[").replace("]", r"\]")):
            llm.generate([prompt], SamplingParams(**params), use_tqdm=False)


def test_drafts_change_neither_tokens_nor_logprobs_under_penalties(
    tiny_path, tmp_path, monkeypatch
):
    """Each verified draft position is processed with the outputs before it (a penalty's counts
    grow inside one step): the same tokens and log-probabilities as decoding one at a time. The
    drafts are the right continuation up to a wrong second one, so some are accepted."""
    from moeinfra.engine.drafting import MtpDrafter

    mtp = init_tiny(tmp_path / "mtp", tokenizer="bpe", config={"num_nextn_predict_layers": 1})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.4, frequency_penalty=0.5)  # fmt: skip
    with LLM(mtp, block_size=4, num_kv_blocks=256) as engine:
        prompt = engine.tokenizer.encode("x")
        plain = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    draft = MtpDrafter.draft

    def oracle(self, *args):
        draft(self, *args)
        for seq in self.core.requests.values():
            if seq.drafts:
                proposed = plain.token_ids[len(seq.output_ids) :][: len(seq.drafts)]
                if len(proposed) > 1:
                    proposed[1] = (proposed[1] + 1) % 1000
                seq.drafts = proposed or seq.drafts

    monkeypatch.setattr(MtpDrafter, "draft", oracle)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(mtp, block_size=4, num_kv_blocks=256, speculative_config=spec) as engine:
        out = engine.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_accepted_tokens > 0
    drafted = out.outputs[0]
    assert drafted.token_ids == plain.token_ids
    for a, b in zip(drafted.logprobs, plain.logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < LOGPROB_TOL


def test_a_grammar_masks_the_embeddings_padding_past_the_tokenizer(llm):
    """DeepSeek-V3's embedding has 129,280 rows for 128,815 tokens: the grammar's mask covers the
    tokens and never allows the padding (a mask shorter than the logits crashed the rank)."""
    import llguidance

    from moeinfra.engine.structured import Grammars

    vocab = llm.tokenizer.vocab_size
    grammars = Grammars(llm.tokenizer, vocab + 100, {1})
    grammar = grammars.matcher(llguidance.LLMatcher.grammar_from_regex("[a-z]{2,4}"), [])
    logits = torch.zeros(vocab + 100)
    grammar.mask(logits)
    allowed = (logits == 0).nonzero().flatten().tolist()
    assert allowed and max(allowed) < vocab
    assert all(llm.tokenizer.decode([t]).isalpha() for t in allowed)
