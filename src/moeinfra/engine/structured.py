"""Structured output: a request's grammar masks every token that cannot continue valid output.

The grammar (``SamplingParams.grammar``) is an llguidance grammar — what
``llguidance.LLMatcher.grammar_from_json_schema`` / ``grammar_from_regex`` / ``grammar_from_lark``
return; the API server builds it from ``response_format``, ``structured_outputs`` or a forced tool
call. Each request keeps a matcher (:class:`Grammar`) that follows its output token by token: the
tokens it does not allow are set to -inf before anything else sees the logits (as vLLM applies its
grammar bitmask; a request's log-probabilities are then renormalised over the allowed tokens), and
once the grammar is complete the request stops. llguidance reads the checkpoint's
``tokenizer.json`` itself (no ``transformers``), and it is imported only when a request has a
grammar.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from moeinfra.errors import InputError


def grammar_error(grammar: str) -> str:
    """Why llguidance refuses ``grammar`` ("" when it is valid)."""
    import llguidance

    try:
        return llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as err:
        return str(err)


class _Vocabulary:
    """The checkpoint's vocabulary as llguidance's ``TokenizerWrapper`` takes it: each token's
    bytes, and as special only the tokens the tokenizer marks special (llguidance's own
    ``tokenizer.json`` reader takes every added token for special, so DeepSeek's tool-call and
    thinking markers could be masked as allowed yet refused when consumed)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = tokenizer.special_token_ids

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class Grammars:
    """The engine's grammar tokenizer, built on first use (~1 s for DeepSeek-V3's 129K
    vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None

    def matcher(self, grammar: str, output_ids: list[int]) -> Grammar:
        """A matcher for ``grammar`` that has followed ``output_ids`` (a request generated
        elsewhere, or recomputed)."""
        import llguidance

        if self._tokenizer is None:
            wrapper = llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer))
            self._tokenizer = llguidance.LLTokenizer(
                wrapper, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InputError(f"grammar is not valid: {matcher.get_error()}")
        if output_ids and not matcher.consume_tokens(list(output_ids)):
            raise InputError(
                f"the output so far does not follow the grammar: {matcher.get_error()}"
            )
        return Grammar(matcher, self.vocab_size)


class Grammar:
    """One request's grammar state."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    def mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar does not allow next to -inf (in place)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.zeros(logits_row.shape[-1], dtype=bool)
        # the mask covers the tokenizer's vocabulary; the embedding's padding past it (DeepSeek-V3:
        # 128,815 tokens, 129,280 rows) is never allowed
        known = np.unpackbits(bits, bitorder="little")[: allowed.size]
        allowed[: known.size] = known
        logits_row[torch.from_numpy(~allowed).to(logits_row.device)] = -math.inf

    def advance(self, token: int) -> bool:
        """Follow one sampled token; True once the grammar is complete (the request stops)."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() or self.matcher.is_error()
