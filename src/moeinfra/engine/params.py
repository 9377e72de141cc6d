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


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request (vLLM's ``SamplingParams`` fields of the same names).

    ``temperature`` 0 (below 1e-5) or ``top_k`` 1 means greedy; ``top_k`` 0 or -1 and ``top_p`` 1
    switch those filters off. ``max_tokens`` None means until a stop or the context length.
    ``stop`` (a str or a list of them) and ``stop_token_ids`` are stored as tuples, so instances are
    hashable and picklable. ``seed`` (in [0, 2**64)) makes the request's tokens reproducible.
    ``min_tokens`` output tokens come before EOS or stop tokens may end the request. Bad values raise
    :class:`~moeinfra.errors.InputError`.
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
        }
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
        stop = (
            () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        )
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise InputError(f"stop={self.stop!r} must be None, a non-empty str or a list of them")
        values["stop"] = tuple(stop)
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, list | tuple) or not all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise InputError(
                f"stop_token_ids={self.stop_token_ids!r} must be None or a list of ints >= 0"
            )
        values["stop_token_ids"] = tuple(int(i) for i in ids)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r} must be a bool")
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax of the logits (temperature below 1e-5 or top_k == 1)."""
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1
