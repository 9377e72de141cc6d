"""Per-request sampling parameters (vLLM's names and defaults), importable without torch so a command
can check them before loading a model."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moeinfra.errors import InputError

# Temperatures below this count as greedy, as in vLLM: dividing logits by them overflows.
_GREEDY_TEMPERATURE = 1e-5


def _checked(
    name: str, value: object, cast: type, ok: Callable[[float], bool], allowed: str
) -> int | float:
    """``cast(value)`` if ``value`` is an int (``cast is int``) or real number and ``ok`` of it."""
    kind = numbers.Integral if cast is int else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not ok(cast(value)):
        raise InputError(f"{name}={value!r} must be {allowed}")
    return cast(value)


#: The most top log-probabilities a request may ask for per position (vLLM's ``max_logprobs``).
MAX_LOGPROBS = 20
#: ``logit_bias`` values are clamped to +-this (vLLM and OpenAI).
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request (vLLM's ``SamplingParams`` fields of the same names).

    ``temperature`` 0 (below 1e-5) or ``top_k`` 1 means greedy; ``top_k`` 0 or -1 and ``top_p`` 1
    switch those filters off. ``max_tokens`` None means until a stop or the context length.
    ``stop`` (a str or a list of them) and ``stop_token_ids`` are stored as tuples, so instances are
    hashable and picklable. ``seed`` (in [0, 2**64)) makes the request's tokens reproducible.
    ``min_tokens`` output tokens come before EOS or stop tokens may end the request. Bad values raise
    :class:`~moeinfra.errors.InputError`.

    Logit processing, in vLLM's order, before the draw (greedy requests included):
    ``allowed_token_ids`` (every other token is masked), ``bad_words`` (a word's last token is
    masked where the output ends with the word's other tokens), ``logit_bias`` (``{token id:
    bias}``, clamped to +-100; stored as sorted pairs), ``repetition_penalty`` (every token of the
    prompt and output: a positive logit divided by it, a negative one multiplied),
    ``frequency_penalty`` (minus its value times the token's count in the output) and
    ``presence_penalty`` (minus its value once the token is in the output). ``min_p`` (after
    temperature) drops tokens less likely than ``min_p`` times the most likely one.

    ``logprobs``: return the log-probability of each output token and the ``logprobs`` most
    likely tokens at its position; ``prompt_logprobs``: the same for every prompt token after the
    first (computed from the whole prompt: such a request takes no prefix-cache hit). Both are
    the log-softmax of the model's raw logits, before any processing (vLLM's default).

    ``grammar``: an llguidance grammar the output must follow (structured output,
    :mod:`~moeinfra.engine.structured`); tokens it does not allow are masked first, and the
    request stops when it is complete. With ``grammar_after`` (a reasoning model's ``</think>``)
    it starts once the output's text holds that: the thinking before it is free, as vLLM
    starts a grammar when reasoning ends.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | Sequence[tuple[int, float]] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: str | None = None
    grammar_after: str | None = None

    def __post_init__(self) -> None:
        values: dict[str, object] = {
            "temperature": _checked(
                "temperature", self.temperature, float, lambda v: 0 <= v < math.inf, "a number >= 0"
            ),
            "top_p": _checked(
                "top_p", self.top_p, float, lambda v: 0 < v <= 1, "a number in (0, 1]"
            ),
            "top_k": _checked(
                "top_k", self.top_k, int, lambda v: v >= -1, "an int: -1 or 0 (off) or >= 1"
            ),
            "min_tokens": _checked(
                "min_tokens", self.min_tokens, int, lambda v: v >= 0, "an int >= 0"
            ),
            "min_p": _checked(
                "min_p", self.min_p, float, lambda v: 0 <= v <= 1, "a number in [0, 1]"
            ),
            "repetition_penalty": _checked(
                "repetition_penalty",
                self.repetition_penalty,
                float,
                lambda v: 0 < v < math.inf,
                "a number > 0",
            ),
        }
        for name in ("presence_penalty", "frequency_penalty"):
            values[name] = _checked(
                name, getattr(self, name), float, lambda v: -2 <= v <= 2, "a number in [-2, 2]"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                values[name] = _checked(
                    name,
                    getattr(self, name),
                    int,
                    lambda v: 0 <= v <= MAX_LOGPROBS,
                    f"None or an int in 0..{MAX_LOGPROBS}",
                )
        if self.max_tokens is not None:
            values["max_tokens"] = _checked(
                "max_tokens", self.max_tokens, int, lambda v: v >= 1, "None or an int >= 1"
            )
            if values["min_tokens"] > values["max_tokens"]:
                raise InputError(
                    f"min_tokens={self.min_tokens!r} must be <= max_tokens={self.max_tokens!r}"
                )
        if self.seed is not None:
            values["seed"] = _checked(
                "seed", self.seed, int, lambda v: 0 <= v < 2**64, "None or an int in [0, 2**64)"
            )
        values["stop"] = _strings("stop", self.stop)
        values["bad_words"] = _strings("bad_words", self.bad_words)
        values["stop_token_ids"] = _token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            values["allowed_token_ids"] = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not values["allowed_token_ids"]:
                raise InputError("allowed_token_ids=[] must hold at least one token id")
        values["logit_bias"] = _logit_bias(self.logit_bias)
        for name in ("grammar", "grammar_after"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InputError(f"{name}={value!r} must be None or a non-empty str")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r} must be a bool")
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax of the logits (temperature below 1e-5 or top_k == 1)."""
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before the draw beyond temperature, top-k, top-p and min-p
        (a bias, a penalty, a token mask): such rows go through
        :func:`~moeinfra.engine.logits_processing.process_logits`."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    def max_token_id(self) -> int:
        """The largest token id the parameters name (-1 when none): checked against the
        vocabulary by the engine."""
        ids = [
            *self.stop_token_ids,
            *(self.allowed_token_ids or ()),
            *(t for t, _ in self.logit_bias),
        ]
        return max(ids, default=-1)


def _strings(name: str, value: object) -> tuple[str, ...]:
    items = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) and s for s in items):
        raise InputError(f"{name}={value!r} must be None, a non-empty str or a list of them")
    return tuple(items)


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    ids = () if value is None else value
    if not isinstance(ids, list | tuple) or not all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise InputError(f"{name}={value!r} must be None or a list of ints >= 0")
    return tuple(int(i) for i in ids)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (or pairs) as sorted pairs, biases clamped to +-MAX_LOGIT_BIAS."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, dict) else value
    allowed = "None or {token id (int >= 0): bias (a number)}"
    try:
        pairs = [(k, b) for k, b in pairs]
    except (TypeError, ValueError):
        raise InputError(f"logit_bias={value!r} must be {allowed}") from None
    out = {}
    for token, bias in pairs:
        if isinstance(token, str) and token.isdigit():
            token = int(token)  # JSON object keys are strings
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise InputError(f"logit_bias={value!r} must be {allowed}: key {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or math.isnan(bias):
            raise InputError(f"logit_bias={value!r} must be {allowed}: value {bias!r}")
        out[int(token)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))
    return tuple(sorted(out.items()))
