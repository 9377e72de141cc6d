"""Results of generation in vLLM's shape: ``RequestOutput.outputs[0].token_ids`` / ``.text``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a request (the engine makes one per request, ``index`` 0)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and completion; ``num_cached_tokens``: prompt tokens from the prefix
    cache; ``num_draft_tokens`` / ``num_accepted_tokens``: speculative draft tokens proposed for it
    and accepted (0 without speculative decoding)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
