"""Results of generation in vLLM's shape (``RequestOutput.outputs[0].token_ids`` / ``.text``) and
what one engine step emits per request (:class:`StepOutput`, a ``msgspec`` struct: it crosses the
units' sockets as MessagePack)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class Logprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one position: of the token there (``token_id``, ``logprob``, its
    ``rank`` among all tokens, 1 = most likely, ties counted against it) and of the most likely
    tokens (``top_ids`` / ``top_logprobs``, most likely first; as many as the request asked for).
    Natural logs of the model's raw distribution."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class StepOutput(msgspec.Struct, omit_defaults=True):
    """What one step did for one request: its new tokens and text, and whether it finished.

    ``logprobs``: one entry per new token when the request asked for them; ``prompt_logprobs``:
    one entry per prompt token after the first, on the request's first output only."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs] | None = None
    queued_s: float = 0.0  # on the first output: seconds from arrival here to the first step


@dataclass
class CompletionOutput:
    """One completion of a request (the engine makes one per request, ``index`` 0)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[Logprobs] | None = None  # per token, when SamplingParams.logprobs is set

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and completion; ``num_cached_tokens``: prompt tokens from the prefix
    cache; ``num_draft_tokens`` / ``num_accepted_tokens``: speculative draft tokens proposed for it
    and accepted (0 without speculative decoding); ``prompt_logprobs``: None for the first prompt
    token, then one entry per prompt token (when ``SamplingParams.prompt_logprobs`` is set)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None
