"""Tokenizer and chat template against transformers' own loading of the same files."""

from __future__ import annotations

import pytest

from moeinfra.engine.tiny import write_tokenizer
from moeinfra.engine.tokenizer import DetokenizeStream, Tokenizer

TEXTS = [
    "Hello, DeepSeek!",
    "Prefill units run EP32; decode units run EP144.",
    "数字 12345 和中文混合 text",
    "  leading spaces\nand a newline",
    "emoji 🙂 and accents: café",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is MLA?"},
    {"role": "assistant", "content": "Latent attention."},
    {"role": "user", "content": "And MoE?"},
]


@pytest.fixture(scope="module", params=["bpe", "deepseek-v3"])
def tokenizer_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_tokenizer(folder, request.param)
    return folder


def test_encode_decode_and_chat_template_equal_transformers(tokenizer_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer(tokenizer_dir)
    ref = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    rendered = ours.apply_chat_template(CONVERSATION)
    expected = ref.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered == expected
    assert rendered.startswith("<｜begin▁of▁sentence｜>You are terse.<｜User｜>What is MLA?")
    assert rendered.endswith("<｜User｜>And MoE?<｜Assistant｜>")
    ids = ours.encode_chat(CONVERSATION)
    expected_ids = ref.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    assert ids == expected_ids["input_ids"]
    assert ids[0] == ours.bos_token_id == 0


def test_deepseek_v3_tokenizer_is_the_real_one(tmp_path):
    write_tokenizer(tmp_path, "deepseek-v3")
    tok = Tokenizer(tmp_path)
    from transformers import AutoTokenizer

    assert tok.vocab_size == len(AutoTokenizer.from_pretrained(str(tmp_path))) > 128000
    assert tok.eos_token == "<｜end▁of▁sentence｜>" and tok.eos_token_id == 1
    assert tok.encode("<｜User｜>", add_special_tokens=False) == [128803]


def test_stream_detokenization_equals_whole_decode(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        stream = DetokenizeStream(tok)
        pieces = [stream.push([i]) for i in ids]
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_detokenization_of_random_ids_in_chunks(tokenizer_dir, skip_special_tokens):
    """Any ids (special tokens, pieces of UTF-8 characters), pushed several at a time: the pieces
    join to the whole decode, short of a trailing incomplete character held back."""
    import random

    tok = Tokenizer(tokenizer_dir)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        stream = DetokenizeStream(tok, skip_special_tokens)
        pieces, i = [], 0
        while i < len(ids):
            n = rng.randrange(1, 4)
            pieces.append(stream.push(ids[i : i + n]))
            i += n
        whole = tok.decode(ids, skip_special_tokens)
        assert stream.text == "".join(pieces)
        assert stream.text == whole or (whole.startswith(stream.text) and whole.endswith("\ufffd"))
